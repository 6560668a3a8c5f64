"""Qwen3.5's fast linear-attention kernels: what a GPU process lacks, and the one warning the driver prints."""

from __future__ import annotations

import sys

import pytest

from lt_opd_ray.core.wire import ActorPlacement
from lt_opd_ray.models.kernels import INSTALL_HINT, missing_kernels, slow_kernels_warning


def test_a_qwen3_5_model_on_a_gpu_without_the_packages_lacks_both():
    assert missing_kernels("qwen3_5", on_gpu=True) == ("fla-core", "causal-conv1d")


def test_nothing_is_missing_on_cpu_or_for_a_family_without_linear_attention():
    assert missing_kernels("qwen3_5", on_gpu=False) == ()
    assert missing_kernels("qwen3_vl", on_gpu=True) == ()
    assert missing_kernels("qwen2_5_vl", on_gpu=True) == ()


@pytest.fixture
def fla_installed(tmp_path, monkeypatch):
    """A package named `fla` exposing the function transformers looks up, importable from sys.path."""
    ops = tmp_path / "fla" / "ops"
    ops.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (ops / "__init__.py").write_text("")
    (ops / "gated_delta_rule.py").write_text("def chunk_gated_delta_rule(*args, **kwargs):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]


def test_an_importable_package_is_not_reported(fla_installed):
    assert missing_kernels("qwen3_5", on_gpu=True) == ("causal-conv1d",)


def test_a_package_that_fails_to_import_counts_as_missing(tmp_path, monkeypatch):
    (tmp_path / "causal_conv1d.py").write_text("raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "causal-conv1d" in missing_kernels("qwen3_5", on_gpu=True)


def test_one_warning_names_every_slow_actor_the_packages_and_the_fix():
    placements = [
        ActorPlacement("learner-0", "n", ("0",), "DeepSpeed ZeRO-3", ("fla-core", "causal-conv1d")),
        ActorPlacement("learner-1", "n", ("1",), "DeepSpeed ZeRO-3", ("fla-core", "causal-conv1d")),
        ActorPlacement("teacher-1", "n", ("6",), "transformers", ("causal-conv1d",)),
        ActorPlacement("rollout-0", "n", ("2",), "vLLM V2 runner"),
    ]
    warning = slow_kernels_warning(placements)
    assert warning.startswith("warning: learner-0, learner-1, teacher-1 run Qwen3.5's Gated DeltaNet layers")
    assert "rollout-0" not in warning
    assert "causal-conv1d, fla-core not installed" in warning and "10x" in warning and INSTALL_HINT in warning
    assert slow_kernels_warning(placements[3:]) is None

