"""Packed rows (models/packing.py): which kernels take a row's bounds at once, and the per-sequence fallback."""

from __future__ import annotations

import torch


class Attention(torch.nn.Module):
    """What packed_attention reads of a layer: causal, grouped-query (2 query heads per key-value head)."""

    is_causal, num_key_value_groups = True, 2


def packed_qkv(device: str, dtype: torch.dtype, lengths=(5, 9, 3)):
    from lt_opd_ray.models.packing import row_bounds

    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(1, heads, total, 16, generator=g).to(device, dtype) for heads in (4, 2, 2))
    return q, k, v, row_bounds(list(lengths))["cu_seq_lens_q"]


def test_a_packed_row_runs_attention_once_per_sequence_where_no_varlen_kernel_is(monkeypatch):
    """On the CPU no kernel takes the row's bounds: the attention runs SDPA on each sequence alone (3 here), and the
    delta rule and the convolution loop likewise (`varlen_kernels` names none)."""
    from lt_opd_ray.models import packing

    assert packing.varlen_kernels(torch.device("cpu"), torch.bfloat16) == frozenset()
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape[2])
        return sdpa(*args, **kwargs)

    sdpa = packing.sdpa_attention_forward
    monkeypatch.setattr(packing, "sdpa_attention_forward", counted)
    q, k, v, bounds = packed_qkv("cpu", torch.float32)
    out, _ = packing.packed_attention(Attention(), q, k, v, None, cu_seq_lens_q=bounds)
    assert calls == [5, 9, 3] and out.shape == (1, 17, 4, 16)
