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

Where a kernel takes the row's bounds itself (`varlen_kernels`: on CUDA, torch's variable-length flash attention, and
fla's chunked gated delta rule where fla is installed), the row runs through it in one call instead of a call per
sequence (at the main job's ~8 sequences a micro-batch, forward, recompute and backward: ~6k launches per rank and
update instead of ~46k); the per-sequence calls are the fallback, and what runs on the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import itertools
import weakref

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from lt_opd_ray.models.kernels import LINEAR_ATTENTION_KERNELS, importable
from lt_opd_ray.models.transfer import to_device

PACKED_ATTENTION = "lt_opd_packed"  # the attention implementation's registered name
_packed_call = contextvars.ContextVar("packed_call", default=False)  # a packed row's forward is running on this thread


def row_bounds(lengths: list[int]) -> dict:
    """The forward argument that marks a packed row's sequences: their bounds [0, l0, l0 + l1, ...], on the host (each
    layer reads them as Python ints: no device sync)."""
    return {"cu_seq_lens_q": torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32)}


@contextlib.contextmanager
def packed_call():
    """Around a packed row's forward: its attention needs no mask (`packed_mask` builds none)."""
    token = _packed_call.set(True)
    try:
        yield
    finally:
        _packed_call.reset(token)


def varlen_kernels(device: torch.device, dtype: torch.dtype) -> frozenset[str]:
    """Which of a packed row's position-mixing functions run the whole row in one kernel here: "attention" (torch's
    variable-length flash attention, CUDA in fp16 / bf16) and "delta_rule" (fla's chunked gated delta rule, CUDA, where
    fla imports). The short convolution is not among them: the causal_conv1d kernel takes sequence ids only in a
    channels-last layout transformers does not give it, so it runs once per sequence everywhere (a width-4 depthwise
    convolution: the cheapest of the three)."""
    if device.type != "cuda":
        return frozenset()
    found = {"delta_rule"} if importable(*LINEAR_ATTENTION_KERNELS["fla-core"]) else set()
    if dtype in (torch.float16, torch.bfloat16) and importable("torch.nn.attention.varlen", "varlen_attn"):
        found.add("attention")
    return frozenset(found)


_on_device: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}  # (id of a row's host bounds, device, dtype) -> its copy


def bounds_on(bounds: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A packed row's host bounds on `device`, copied once for the row: every layer of its forward and of its
    recompute reads the one copy (no copy per layer, and fla keys its per-row caches by the tensor)."""
    key = (id(bounds), device, dtype)
    held = _on_device.get(key)
    if held is not None and held[0]() is bounds:
        return held[1]
    for stale in [k for k, (ref, _) in _on_device.items() if ref() is None]:
        del _on_device[stale]
    copy = to_device(bounds, device, dtype)
    _on_device[key] = (weakref.ref(bounds), copy)
    return copy


def fla_delta_rule():
    """fla's chunked gated delta rule itself (transformers' dispatcher would drop `cu_seqlens` for a kernel it had
    not resolved to, and run the row as one sequence)."""
    module, function = LINEAR_ATTENTION_KERNELS["fla-core"]
    return getattr(importlib.import_module(module), function)


def spans(bounds: torch.Tensor) -> list[tuple[int, int]]:
    edges = bounds.tolist()
    return list(zip(edges, edges[1:]))


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA, or SDPA per sequence of a packed row when the call carries its bounds. query [1, heads, L, d]; key and
    value [1, kv heads, P + L, d], where a row continuing a cached prefix of P positions has every sequence see all of
    it (the teacher's responses after their prompt), then itself causally."""
    bounds = kwargs.pop("cu_seq_lens_q", None)
    if bounds is None or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("sliding_window"):
        raise ValueError("packed rows do not cover sliding-window attention: set pools.*.packing false")
    prefix = key.shape[2] - query.shape[2]
    if prefix == 0 and not dropout and "attention" in varlen_kernels(query.device, query.dtype):
        from torch.nn.attention.varlen import varlen_attn

        longest = max(end - start for start, end in spans(bounds))  # the bounds live on the host: no sync
        on_device = bounds_on(bounds, query.device, torch.int32)
        rows = [t[0].transpose(0, 1) for t in (query, key, value)]  # [L, heads, d]
        out = varlen_attn(*rows, on_device, on_device, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=True)
        return out[None], None  # [1, L, heads, d], as SDPA's forward returns it
    outputs = []
    for start, end in spans(bounds):
        if prefix == 0:  # causal on the sequence alone: SDPA's fused kernels, no mask
            outputs.append(sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                                                  scaling=scaling, dropout=dropout, is_causal=True)[0])
            continue
        keys, values = (torch.cat([t[:, :, :prefix], t[:, :, prefix + start : prefix + end]], dim=2) for t in (key, value))
        groups = getattr(module, "num_key_value_groups", 1)
        # query j of the sequence sees the prefix and the sequence's first j + 1 positions: causal, aligned lower right
        out = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], repeat_kv(keys, groups), repeat_kv(values, groups), dropout_p=dropout, scale=scaling,
            attn_mask=causal_lower_right(end - start, prefix + end - start))
        outputs.append(out.transpose(1, 2))  # [1, length, heads, d], as SDPA's forward returns it
    return torch.cat(outputs, dim=1).contiguous(), None


def packed_mask(*args, **kwargs):
    """SDPA's mask, but none for a packed row (its attention masks itself per sequence: a [L, P + L] mask would be
    built for nothing)."""
    return None if _packed_call.get() else ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)


def use_packed_attention(model) -> None:
    """Give `model`'s attention `packed_attention` (once; what was SDPA stays SDPA for every unpacked call), and
    Qwen3.5's linear attention its per-sequence functions. Refused where either would not take."""
    segment_linear_attention()  # once per process
    if model.config.get_text_config()._attn_implementation == PACKED_ATTENTION:
        return  # the model was set up by an earlier call: every packed forward comes here first
    model.set_attn_implementation(PACKED_ATTENTION)
    if model.config.get_text_config()._attn_implementation != PACKED_ATTENTION:
        raise ValueError(f"{type(model).__name__} keeps its attention implementation: packed rows need pools.*.packing false")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    for module in model.modules():  # another family's linear attention calls functions of its own, which nothing wraps
        if type(module).__name__.endswith("GatedDeltaNet") and type(module).__module__ != qwen3_5.__name__:
            raise ValueError(f"packed rows do not cover {type(module).__name__} ({type(module).__module__}): set pools.*.packing false")


def segment_linear_attention() -> None:
    """Wrap (once per process) the two functions of Qwen3.5's Gated DeltaNet that mix positions so that, given a
    packed row's bounds, each runs on one sequence at a time; without bounds they are called as they were."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    if getattr(qwen3_5.causal_conv1d_fn, "per_sequence", False):
        return
    convolution, delta_rule = qwen3_5.causal_conv1d_fn, qwen3_5.torch_chunk_gated_delta_rule

    def conv_per_sequence(hidden_states, weight, bias=None, activation=None, **kwargs):
        """hidden_states [1, channels, W + L]: a row continuing a cache starts with the cache's window of W positions,
        which each sequence sees before its own (the W outputs before the row's are the layer's to drop)."""
        bounds = kwargs.pop("cu_seq_lens_q", None)
        if bounds is None:
            return convolution(hidden_states, weight, bias, activation=activation, **kwargs)
        window = hidden_states.shape[-1] - int(bounds[-1])
        before, row = hidden_states[..., :window], hidden_states[..., window:]
        outputs = [convolution(torch.cat([before, row[..., start:end]], dim=-1) if window else row[..., start:end], weight, bias,
                               activation=activation)[..., window:] for start, end in spans(bounds)]
        return torch.cat([torch.zeros_like(before), *outputs], dim=-1)

    def delta_rule_per_sequence(query, key, value, *args, cu_seqlens=None, **kwargs):
        """[1, L, heads, d] (g, beta [1, L, heads]); each sequence starts from `initial_state` (a cached prefix's, or
        none). The state returned is the initial one: after a packed row the cache holds no one sequence's state."""
        if cu_seqlens is None:
            return delta_rule(query, key, value, *args, **kwargs)
        if kwargs.get("initial_state") is None and "delta_rule" in varlen_kernels(query.device, query.dtype):
            kernel = fla_delta_rule()  # the row at once: fla's varlen path
            accepted = inspect.signature(kernel).parameters
            given = {**kwargs, "cu_seqlens_cpu": cu_seqlens.to(torch.long)}  # fla releases that take the host bounds read no device copy
            return kernel(query, key, value, *args, cu_seqlens=bounds_on(cu_seqlens, query.device, torch.long),
                          **{name: setting for name, setting in given.items() if name in accepted})
        if kwargs.get("output_final_state") and kwargs.get("initial_state") is None:
            raise ValueError("a packed row has no one state to cache: run it without use_cache")
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        outputs = [delta_rule(query[:, start:end], key[:, start:end], value[:, start:end], *args, g=g[:, start:end], beta=beta[:, start:end], **kwargs)[0]
                   for start, end in spans(cu_seqlens)]
        return torch.cat(outputs, dim=1), kwargs.get("initial_state")

    conv_per_sequence.per_sequence = True
    qwen3_5.causal_conv1d_fn, qwen3_5.torch_chunk_gated_delta_rule = conv_per_sequence, delta_rule_per_sequence
