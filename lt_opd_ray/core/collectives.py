"""The one place our code hands tensors to a collective, and a guard that holds every collective to NCCL's rule.

NCCL takes tensors on the rank's current CUDA device only ("no backend for device
cpu" otherwise); gloo takes host tensors. So a tensor that works under gloo on a CPU
box can stop a GPU run on its first micro-batch. `backend_device` says where a
backend's tensors live, and our collectives (`all_reduce_max` here, the weight sync's
`SyncGroup`) place their tensors there themselves.

`LT_OPD_CHECK_COLLECTIVES=1` (read when a process group is formed) installs a guard in
the process: every collective call, ours or DeepSpeed's, is refused unless each tensor
lies on its backend's device, and a collective called directly from any other module
of this package (bypassing the placement here) is refused by name and line. On CPU
the tests run the learner group and the weight sync under it.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

GUARD_ENV = "LT_OPD_CHECK_COLLECTIVES"
PACKAGE = Path(__file__).resolve().parents[1]
# modules of this package allowed to call torch.distributed collectives: they place the tensors themselves
PLACING_MODULES = {Path(__file__).resolve(), PACKAGE / "weight_sync" / "group.py"}
DIST_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "reduce", "gather", "scatter", "all_to_all_single",
)
GROUP_COLLECTIVES = ("broadcast", "allreduce", "allgather", "reduce_scatter", "_allgather_base", "_reduce_scatter_base")


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective off its backend's device, or a collective that bypasses `collectives`."""


def backend_device(backend: str) -> torch.device:
    """Where a backend's collectives take their tensors: NCCL the rank's current CUDA device, others the host."""
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_group():
    """A gloo group over the default group's ranks, for what the host decides in lockstep (the learners' flags and
    counts): under NCCL those would be device tensors, each read back to the host behind the forward or backward queued
    before it; on gloo they are host values, reduced without waiting for the device. Every rank calls it, in the same
    order (a new group is a collective)."""
    return dist.new_group(backend="gloo")


def all_reduce_max(values: list[int], group=None) -> list[int]:
    """Element-wise maximum of small integers over the group (the learners' lockstep flags)."""
    flags = torch.tensor(values, dtype=torch.int64, device=backend_device(dist.get_backend(group)))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.tolist()  # to the host: under NCCL this waits for the reduction


def all_reduce_sum(values: list[int], group=None) -> list[int]:
    """Element-wise sum of small integers over the group (counts every rank needs whole, as an update's tokens)."""
    counts = torch.tensor(values, dtype=torch.int64, device=backend_device(dist.get_backend(group)))
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return counts.tolist()


def hold_every_group_for(seconds: float) -> None:
    """Every process group of this process waits up to `seconds` in a collective. torch gives a group made by
    `new_group` without a timeout its backend's default (NCCL 10 min, gloo 30 min), not the default group's, and
    DeepSpeed makes its data-parallel group (ZeRO's gradient reduce, ZeRO-3's gathers) that way. torch has no public
    call for an existing group's timeout: `_set_pg_timeout` is the one its own tests use."""
    timeout = timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


# ------------------------------------------------------------------------------------------------- the guard
def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _check(what: str, backend: str, args, kwargs) -> None:
    caller = sys._getframe(2)  # the frame that called the collective (1 is the guard's wrapper)
    path = Path(caller.f_code.co_filename).resolve()
    if path.is_relative_to(PACKAGE) and path not in PLACING_MODULES:
        raise CollectiveDeviceError(
            f"{path.relative_to(PACKAGE.parent)}:{caller.f_lineno} calls {what} directly; a collective of this package goes"
            " through lt_opd_ray.core.collectives (or the weight sync's SyncGroup), which place its tensors on the"
            " backend's device"
        )
    device = backend_device(backend)
    for tensor in _tensors(list(args) + list(kwargs.values())):
        if tensor.device != device:
            raise CollectiveDeviceError(
                f"{what} on {backend} got a tensor on {tensor.device} (shape {tuple(tensor.shape)}); {backend} takes tensors"
                f" on {device} only (called from {path.name}:{caller.f_lineno})"
            )


def _group_backend(args, kwargs) -> str:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return dist.get_backend(group)


def _guard_function(module, name: str) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "lt_opd_guarded", False):
        return

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        _check(f"torch.distributed.{name}", _group_backend(args, kwargs), args, kwargs)
        return original(*args, **kwargs)

    guarded.lt_opd_guarded = True
    setattr(module, name, guarded)


def _guard_group_class(cls, backend: str) -> None:
    for name in GROUP_COLLECTIVES:
        original = getattr(cls, name, None)
        if original is None or getattr(original, "lt_opd_guarded", False):
            continue

        def guarded(self, *args, _original=original, _name=name, **kwargs):
            _check(f"{cls.__name__}.{_name}", backend, args, kwargs)
            return _original(self, *args, **kwargs)

        guarded.lt_opd_guarded = True
        setattr(cls, name, guarded)


def install_guard() -> None:
    """Hold every collective of this process to its backend's device rule (idempotent)."""
    for name in DIST_COLLECTIVES:
        _guard_function(dist, name)
    _guard_group_class(dist.ProcessGroupGloo, "gloo")
    if hasattr(dist, "ProcessGroupNCCL"):
        _guard_group_class(dist.ProcessGroupNCCL, "nccl")


def install_guard_if_asked() -> None:
    if os.environ.get(GUARD_ENV) == "1":
        install_guard()
