"""Make `import torchvision` work beside a CPU-only torch, in every process of the venv.

PyPI's torchvision wheels are CUDA builds: next to torch+cpu their compiled ops
(`torchvision/_C.so`) fail to load, and `import torchvision` then dies on
`operator torchvision::nms does not exist` (its fake-tensor registrations need the
op schemas). transformers' image utilities and vLLM's multimodal processing import
torchvision, also in subprocesses vLLM starts itself. So scripts/setup.sh puts a
`.pth` line in the venv that calls `install_import_hook()` at interpreter start: a
finder that, the first time anything imports torchvision, registers the two schemas
(without kernels) and then lets the normal import proceed. Nothing happens when
torchvision's own ops load (a build that fits the installed torch).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_registered: list = []  # a torch Library unregisters its ops when collected: keep it


def register_missing_schemas() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or _registered:
        return
    import torch

    compiled = list(Path(spec.origin).parent.glob("_C*.so"))
    try:
        if compiled:
            torch.ops.load_library(str(compiled[0]))
            return  # a torchvision build that fits this torch: its own ops are registered
    except OSError:
        pass
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _registered.append(library)


class _BeforeTorchvision:
    """sys.meta_path entry: on the first `import torchvision`, register the schemas, then step aside."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            register_missing_schemas()
        return None  # the regular finders import the module


def install_import_hook() -> None:
    if "torchvision" in sys.modules or any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())
