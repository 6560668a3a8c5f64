"""lt-opd-ray: low-token on-policy self-distillation for vision-language models, on Ray."""

__version__ = "0.1.0"
