"""Packed rows: a micro-batch's sequences laid end to end in one row, so the language model computes their tokens and
no padding (`pools.learner.packing`).

Every layer that mixes positions is told where one sequence ends and the next begins (the row's bounds, transformers'
`cu_seq_lens_q`, which reaches every layer's attention), and nothing crosses a bound:
- full attention: `packed_attention`, the language model's attention implementation (`use_packed_attention`), runs
  causal attention on each sequence alone (torch's SDPA, whose fused kernels need no mask) when a call carries the
  bounds, and is transformers' SDPA itself otherwise (padded batches, caches, decoding: unchanged);
- Qwen3.5's Gated DeltaNet layers mix positions in two functions, the short causal convolution and the gated delta
  rule's recurrent state: each runs on each sequence alone (wrapped once per process, `segment_linear_attention`), so
  neither the convolution's window nor the state reaches the next sequence. The layer's projections run once over
  the row (under ZeRO-3 its weights are gathered once, not per sequence).
Every other layer (projections, MLPs, norms, the head) works per token and runs over the whole row at once.
"""

from __future__ import annotations

import itertools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

PACKED_ATTENTION = "lt_opd_packed"  # the attention implementation's registered name


def row_bounds(lengths: list[int], device) -> dict:
    """The forward argument that marks a packed row's sequences: their bounds [0, l0, l0 + l1, ...]."""
    return {"cu_seq_lens_q": torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32, device=device)}


def spans(bounds: torch.Tensor) -> list[tuple[int, int]]:
    edges = bounds.tolist()
    return list(zip(edges, edges[1:]))


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA, or SDPA per sequence of a packed row when the call carries its bounds. query/key/value: [1, heads, L, d]."""
    bounds = kwargs.pop("cu_seq_lens_q", None)
    if bounds is None or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    outputs = [sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                                      scaling=scaling, dropout=dropout, is_causal=True)[0]
               for start, end in spans(bounds)]  # each [1, length, heads, d]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
# Its masks are SDPA's: a packed row's all-ones padding mask lets SDPA's mask be skipped (None), and the bounds do the rest.
AttentionMaskInterface.register(PACKED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_packed_attention(model) -> None:
    """Give `model`'s attention `packed_attention` (once; what was SDPA stays SDPA for every unpacked call), and
    Qwen3.5's linear attention its per-sequence functions."""
    if model.config._attn_implementation != PACKED_ATTENTION:
        model.set_attn_implementation(PACKED_ATTENTION)
    segment_linear_attention()


def segment_linear_attention() -> None:
    """Wrap (once per process) the two functions of Qwen3.5's Gated DeltaNet that mix positions so that, given a
    packed row's bounds, each runs on one sequence at a time; without bounds they are called as they were."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    if getattr(qwen3_5.causal_conv1d_fn, "per_sequence", False):
        return
    convolution, delta_rule = qwen3_5.causal_conv1d_fn, qwen3_5.torch_chunk_gated_delta_rule

    def conv_per_sequence(hidden_states, weight, bias=None, activation=None, **kwargs):  # hidden_states [1, channels, L]
        bounds = kwargs.pop("cu_seq_lens_q", None)
        if bounds is None:
            return convolution(hidden_states, weight, bias, activation=activation, **kwargs)
        return torch.cat([convolution(hidden_states[..., start:end], weight, bias, activation=activation) for start, end in spans(bounds)], dim=-1)

    def delta_rule_per_sequence(query, key, value, *args, cu_seqlens=None, **kwargs):  # [1, L, heads, d]; g, beta [1, L, heads]
        if cu_seqlens is None:
            return delta_rule(query, key, value, *args, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise ValueError("a packed row runs without a cache")
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        outputs = [delta_rule(query[:, start:end], key[:, start:end], value[:, start:end], *args, g=g[:, start:end], beta=beta[:, start:end], **kwargs)[0]
                   for start, end in spans(cu_seqlens)]
        return torch.cat(outputs, dim=1), None

    conv_per_sequence.per_sequence = True
    qwen3_5.causal_conv1d_fn, qwen3_5.torch_chunk_gated_delta_rule = conv_per_sequence, delta_rule_per_sequence
