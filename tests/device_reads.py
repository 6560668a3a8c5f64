"""A CPU stand-in for CUDA's sync debug mode: which calls would make the host wait for an accelerator (tests of the
hot paths).

On the CPU every tensor is on the host, so the device's tensors are tracked as a GPU would hold them: the `roots`
(a model's parameters), every tensor copied to the device (`.to(device)` makes a new tensor, as a copy to a GPU does),
and everything an operator computes from them. Counted, as torch's sync debug mode counts them on CUDA:
- a value read back: any operator that needs it on the host (`aten._local_scalar_dense`: item, float, int, bool,
  and indexing by a 0-dim tensor, which reads it inside torch), a data-dependent size (nonzero, masked_select, unique,
  bincount, repeat_interleave without output_size, indexing by a mask), seen at the dispatcher, so reads inside
  torch's own C++ count too; a device tensor's values copied to the host (tolist, numpy, cpu);
- a blocking copy to the device (`.to(device)` or `copy_` of a host tensor without non_blocking=True;
  `torch.tensor` / `torch.as_tensor` with device=), which waits for the device's queue to drain first.
A view written in place with device values taints its base. A factory's device= (zeros, arange, ...) cannot be told
here from a host one (transformers builds positions on `input_ids.device`, the host), so what factories make is
tracked only through what it is then computed with.
What it cannot see: a pageable host-to-device copy the driver itself chooses to stage synchronously (large copies;
pinned memory avoids it), and reads in code that bypasses torch's dispatcher.
`seen` holds (what, where): the innermost frame in this package or in transformers.
"""

from __future__ import annotations

import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim", "unique_consecutive", "argwhere",
         "bincount", "equal", "is_nonzero", "allclose"}
HOST_COPIES = {"tolist", "numpy", "cpu", "__array__"}  # a device tensor's values brought to the host



def _innermost() -> str:
    """The innermost frame's file in this package or in transformers (the call being counted came from it)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/lt_opd_ray/" in f.filename or "/transformers/" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _where() -> str:
    return _innermost().split("/site-packages/")[-1].split("/work/main/")[-1]


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
        if from_device and name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.owner.seen.append(("repeat_interleave without output_size", _where()))
        if from_device and name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1])):
            self.owner.seen.append(("index by a mask", _where()))
        out = func(*args, **kwargs)
        if from_device:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.owner.device.add(t)
            written = args[0] if args and isinstance(args[0], torch.Tensor) and (name.endswith("_") or name in ("copy", "index_put")) else None
            if written is not None:  # an in-place write of device values: the tensor, and what it is a view of, hold them
                self.owner.device.add(written)
                if written._base is not None:
                    self.owner.device.add(written._base)
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
        # a move to the device: made by this package's code, which moves to the model's device (transformers also moves
        # tensors to the host's, `input_ids.device`, which on a CPU cannot be told apart: its moves count by what they carry)
        to_device = name == "to" and "/lt_opd_ray/" in _innermost() and (
            any(isinstance(a, (torch.device, str)) for a in args[1:2]) or "device" in kwargs
            or (len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1] in self.device))
        blocking = not kwargs.get("non_blocking", any(a is True for a in args[2:]))
        if to_device and args[0] not in self.device and blocking:
            self.seen.append(("blocking copy to the device", _where()))
        made_there = name in ("tensor", "as_tensor") and "device" in kwargs  # a host value copied to the device
        if made_there:
            self.seen.append(("blocking copy to the device", _where()))
        if name == "copy_" and args[0] in self.device and isinstance(args[1], torch.Tensor) and args[1] not in self.device and blocking:
            self.seen.append(("blocking copy to the device", _where()))
        if name in HOST_COPIES and args and args[0] in self.device:
            self.seen.append((f"{name}: to the host", _where()))
        out = func(*args, **kwargs)
        if name in HOST_COPIES:
            return out  # the host copy is a host tensor
        if to_device and out is args[0]:
            out = out.clone()  # a GPU copy is a new tensor: the host one is not marked with it
        if to_device or made_there:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.device.add(t)
        return out
