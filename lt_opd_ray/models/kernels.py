"""Qwen3.5's Gated DeltaNet kernels: which fast ones this process can use on its GPU.

transformers runs Qwen3.5's linear-attention layers (24 of its 32) with the kernels of two
packages when they import (flash-linear-attention's `fla` for the chunked and recurrent
gated delta rule, `causal_conv1d` for the short convolution), and otherwise falls back to
reference PyTorch loops: correct, but by transformers' own note more than 10x slower on an
H100 for the chunked delta rule. The learner and the transformers teacher report what they
lack in their placement, and the driver prints one warning at start (`slow_kernels_warning`).
vLLM brings its own kernels for these layers, so its engines need neither package.
"""

from __future__ import annotations

import importlib

from lt_opd_ray.core.families import FAMILIES

# pip distribution -> (module, function) transformers looks up for Qwen3.5's linear attention
LINEAR_ATTENTION_KERNELS = {
    "fla-core": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "causal-conv1d": ("causal_conv1d", "causal_conv1d_fn"),
}
INSTALL_HINT = "pip install --no-build-isolation 'lt-opd-ray[gpu]'"


def importable(module: str, function: str) -> bool:
    try:
        return callable(getattr(importlib.import_module(module), function, None))
    except Exception:  # noqa: BLE001 - a broken install (no triton, a CUDA mismatch) is as good as none
        return False


def missing_kernels(model_type: str | None, on_gpu: bool | None = None) -> tuple[str, ...]:
    """The kernel packages a transformers model of `model_type` would fall back from here (only on a GPU: on
    CPU the reference kernels are what runs, whatever is installed)."""
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    if not on_gpu or model_type not in FAMILIES or not FAMILIES[model_type].linear_attention:
        return ()
    return tuple(package for package, (module, function) in LINEAR_ATTENTION_KERNELS.items() if not importable(module, function))


def slow_kernels_warning(placements) -> str | None:
    """One line naming the actors that run reference kernels, the packages they lack and the slowdown; None when none do."""
    slow = [p for p in placements if p.missing_kernels]
    if not slow:
        return None
    packages = sorted({package for p in slow for package in p.missing_kernels})
    return (f"warning: {', '.join(p.actor for p in slow)} run Qwen3.5's Gated DeltaNet layers on transformers' reference"
            f" PyTorch kernels ({', '.join(packages)} not installed there): more than 10x slower on GPU for 24 of the"
            f" model's 32 layers. Install them: {INSTALL_HINT}")
