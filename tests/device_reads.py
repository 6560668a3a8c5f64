"""A CPU stand-in for CUDA's sync debug mode: which calls would wait for an accelerator (tests of the hot paths)."""

from __future__ import annotations

import traceback
import weakref

import torch


class DeviceReads(torch.overrides.TorchFunctionMode):
    """Counts the reads that would wait for an accelerator: a value read to the host (item, float, int, bool, tolist)
    or a data-dependent shape (nonzero, indexing by a boolean mask) of a tensor that lives on the device. On the CPU
    every tensor is on the host, so the device ones are tracked as a GPU would hold them: `roots` (the model's
    parameters), every tensor moved with `.to` (a new tensor, as a copy to a GPU is), and everything computed from
    them. `seen` holds (what, where) of each read: the innermost frame in this package or in transformers."""

    READS = {"item", "__float__", "__int__", "__bool__", "tolist", "nonzero", "masked_select", "unique", "argwhere"}

    def __init__(self, roots):
        super().__init__()
        self.device: dict[int, weakref.ref] = {}
        self.seen: list[tuple[str, str]] = []
        for tensor in roots:
            self._mark(tensor)

    def _mark(self, tensor: torch.Tensor) -> None:
        self.device[id(tensor)] = weakref.ref(tensor)

    def _on_device(self, tensor) -> bool:
        ref = self.device.get(id(tensor))
        return isinstance(tensor, torch.Tensor) and ref is not None and ref() is tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_device = any(self._on_device(t) for t in inputs)
        masks = [i for i in (args[1] if name in ("__getitem__", "__setitem__") and isinstance(args[1], tuple)
                             else args[1:2] if name in ("__getitem__", "__setitem__") else ())
                 if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
        if (name in self.READS and from_device) or (masks and from_device):
            frames = [f for f in traceback.extract_stack()[:-1] if "/lt_opd_ray/" in f.filename or "/transformers/" in f.filename]
            where = f"{frames[-1].filename.split('/site-packages/')[-1].split('/work/main/')[-1]}:{frames[-1].lineno}" if frames else "?"
            self.seen.append((name, where))
        out = func(*args, **kwargs)
        if name == "to" and out is (args[0] if args else None):
            out = out.clone()  # a GPU copy is a new tensor: the host one is not marked with it
        if from_device or name == "to":
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out
