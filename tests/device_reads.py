"""A CPU stand-in for CUDA's sync debug mode: which calls would make the host wait for an accelerator (tests of the
hot paths).

On the CPU every tensor is on the host, so the device's tensors are tracked as a GPU would hold them: the `roots`
(a model's parameters), every tensor copied to the device (`.to(device)` makes a new tensor, as a copy to a GPU does),
and everything an operator computes from them. Counted, as torch's sync debug mode counts them on CUDA:
- a value read back: any operator that needs it on the host (`aten._local_scalar_dense`: item, float, int, bool,
  and indexing by a 0-dim tensor, which reads it inside torch), a data-dependent size (nonzero, masked_select, unique,
  indexing by a mask), seen at the dispatcher, so reads inside torch's own C++ count too;
- a blocking copy to the device (`.to(device)` of a host tensor without non_blocking=True; `torch.tensor(..., device=)`),
  which waits for the device's queue to drain first.
`seen` holds (what, where): the innermost frame in this package or in transformers.
"""

from __future__ import annotations

import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim", "unique_consecutive", "argwhere"}


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/lt_opd_ray/" in f.filename or "/transformers/" in f.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.split('/site-packages/')[-1].split('/work/main/')[-1]}:{frame.lineno}"


class _Tracked:
    """The tensors that live on the device, by id (a tensor's == is elementwise: no set or dict keyed by tensors)."""

    def __init__(self):
        self.refs: dict[int, weakref.ref] = {}

    def add(self, tensor: torch.Tensor) -> None:
        self.refs[id(tensor)] = weakref.ref(tensor)

    def __contains__(self, tensor) -> bool:
        ref = self.refs.get(id(tensor))
        return isinstance(tensor, torch.Tensor) and ref is not None and ref() is tensor


class _Operators(TorchDispatchMode):
    def __init__(self, owner: DeviceReads):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        from_device = any(t in self.owner.device for t in tree_leaves((args, kwargs)))
        if from_device and name in READS:
            self.owner.seen.append((name, _where()))
        if from_device and name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1])):
            self.owner.seen.append(("index by a mask", _where()))
        out = func(*args, **kwargs)
        if from_device:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.owner.device.add(t)
        return out


class DeviceReads(TorchFunctionMode):
    """Counts the calls that would wait for an accelerator (see the module's docstring) while it is entered."""

    def __init__(self, roots):
        super().__init__()
        self.device = _Tracked()
        self.seen: list[tuple[str, str]] = []
        for tensor in roots:
            self.device.add(tensor)
        self._operators = _Operators(self)

    def __enter__(self):
        self._operators.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._operators.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_device = name == "to" and (any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs)
        if to_device and args[0] not in self.device and not kwargs.get("non_blocking", False):
            self.seen.append(("blocking copy to the device", _where()))
        if name == "tensor" and "device" in kwargs:
            self.seen.append(("blocking copy to the device", _where()))
        out = func(*args, **kwargs)
        if to_device and out is args[0]:
            out = out.clone()  # a GPU copy is a new tensor: the host one is not marked with it
        if to_device or (name == "tensor" and "device" in kwargs):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.device.add(t)
        return out
