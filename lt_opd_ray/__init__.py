"""lt-opd-ray: low-token on-policy self-distillation for vision-language models, on Ray."""

from lt_opd_ray._torchvision_ops import install_import_hook

__version__ = "0.1.0"

install_import_hook()  # also done at interpreter start by the venv's .pth line (scripts/setup.sh)
