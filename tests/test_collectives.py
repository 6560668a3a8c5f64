"""Every collective on its backend's device: the placement in core/collectives.py and the guard that checks it."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lt_opd_ray
from lt_opd_ray.core import collectives
from lt_opd_ray.core.collectives import CollectiveDeviceError, all_reduce_max, backend_device, install_guard
from lt_opd_ray.weight_sync.group import SyncGroup, host_store


@pytest.fixture()
def gloo_world_of_one(tmp_path):
    install_guard()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_backends_take_their_own_devices():
    assert backend_device("gloo") == torch.device("cpu")
    if torch.cuda.is_available():
        assert backend_device("nccl") == torch.device("cuda", torch.cuda.current_device())


def test_the_lockstep_flags_reduce_on_the_backends_device(gloo_world_of_one):
    assert all_reduce_max([True, False]) == [1, 0]


def test_a_tensor_off_the_backends_device_is_refused_before_the_backend_sees_it(gloo_world_of_one):
    with pytest.raises(CollectiveDeviceError, match=r"all_reduce on gloo got a tensor on meta .*takes tensors on cpu only"):
        dist.all_reduce(torch.zeros(2, device="meta"))


def test_a_collective_called_from_the_package_outside_the_placing_modules_is_refused(gloo_world_of_one):
    """The line the learner had (a host tensor straight into the default group, NCCL's on GPU), run as package code."""
    learner = Path(lt_opd_ray.__file__).parent / "runtime" / "learner.py"
    code = compile("dist.all_reduce(torch.tensor([1, 0]), op=dist.ReduceOp.MAX)", str(learner), "exec")
    with pytest.raises(CollectiveDeviceError, match=r"lt_opd_ray/runtime/learner.py:1 calls torch.distributed.all_reduce directly"):
        exec(code, {"dist": dist, "torch": torch})


def test_the_weight_sync_group_is_guarded_too(tmp_path):
    install_guard()
    store = host_store("127.0.0.1", 0, 1, 30.0)
    group = SyncGroup(store, 0, 1, 1, 30.0)
    with pytest.raises(CollectiveDeviceError, match=r"ProcessGroupGloo.broadcast on gloo got a tensor on meta"):
        group.group.broadcast([torch.zeros(3, device="meta")], dist.BroadcastOptions())
    assert group._broadcast(torch.arange(3)).tolist() == [0, 1, 2]


def test_the_test_suite_runs_under_the_guard():
    assert os.environ.get(collectives.GUARD_ENV) == "1"  # set by conftest: Ray actors and CLI runs inherit it
