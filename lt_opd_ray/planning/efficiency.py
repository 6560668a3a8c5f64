"""Analytic prefill FLOPs and cache bytes of a Qwen VLM at a visual budget.

FLOPs are 2 per multiply-accumulate of every matrix product (projections, MLPs,
attention scores and values, the Gated DeltaNet state products); norms,
activations, RoPE and softmax are not counted. Attention is counted over the full
L x L score matrix, as FLOP counters and the token-pruning literature do.

- Language model: every layer's projections and MLP for each of the L prefill
  tokens (text + kept visual tokens); full-attention layers add 4 L^2 H d;
  Gated DeltaNet layers add their depthwise causal conv (2 K C per token) and the
  recurrent state products (S k, the rank-1 state update, S^T q: 6 dk dv per value
  head per token; chunked kernels do the same math blocked).
- Vision tower (+ merger and Qwen3-VL's deepstack mergers): runs on all N tokens
  before the selector, so it does not shrink with the budget.
- Learnable token merge (selector.merge): the N x K cosines of the assignment and the head's products on
  the N tokens and the K kept ones; its parameters: 64 (2D + 2).
- Pruning inside the language model (FastV): the layers up to its scoring layer at every visual token, the scoring
  row of the last prompt token (2 L H d), the layers after it at the kept ones; each layer's cache at its own length.
- Cache: only full-attention layers keep keys and values (2 L Hkv d per layer);
  a Gated DeltaNet layer keeps a fixed-size conv state ((K-1) C; transformers
  keeps K columns) and recurrent state (Hv dk dv, fp32 in Qwen3.5), whatever L is.
"""

from __future__ import annotations

from dataclasses import dataclass

from lt_opd_ray.core.curriculum import tokens_to_keep
from lt_opd_ray.core.families import family_of_config
from lt_opd_ray.core.fastv_layers import scoring_layer


@dataclass(frozen=True)
class PrefillCost:
    prefill_tokens: int  # language-model prefill length: text + kept visual tokens (pruned inside it: + every visual token)
    visual_tokens: int  # kept visual tokens
    lm_flops: int  # language model, without the output head
    vision_flops: int  # vision tower + merger(s), on every visual token
    kv_cache_bytes: int  # keys + values of the full-attention layers
    linear_state_bytes: int  # Gated DeltaNet conv + recurrent states (independent of L)
    merge_flops: int = 0  # learnable token merge, when on


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def layer_kinds(config: dict) -> list[str]:
    text = _text(config)
    return list(text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"])


def _head_dim(text: dict) -> int:
    return text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]


def _output_gate(config: dict) -> bool:
    """Qwen3.5's full-attention layers gate their output (q_proj emits the gate); its configs may leave the flag out."""
    text = _text(config)
    flag = text.get("attn_output_gate")
    return bool(flag) if flag is not None else family_of_config(config).attention_output_gate


def _gdn_channels(text: dict) -> int:
    """Channels of the GDN conv: q and k (Hk dk each) and v (Hv dv)."""
    return 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"] + text["linear_num_value_heads"] * text["linear_value_head_dim"]


def _projection_flops(config: dict, kind: str) -> int:
    """One layer's linear layers for one token."""
    text = _text(config)
    d_model, heads, kv_heads, d = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"], _head_dim(text)
    mlp = 2 * 3 * d_model * text["intermediate_size"]  # gate, up, down (SwiGLU)
    if kind == "full_attention":
        gate = 2 if _output_gate(config) else 1  # Qwen3.5's q_proj also emits the attention output gate
        return mlp + 2 * d_model * heads * d * gate + 2 * 2 * d_model * kv_heads * d + 2 * heads * d * d_model
    values = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    return (mlp + 2 * d_model * _gdn_channels(text)  # in_proj_qkv
            + 2 * d_model * values  # in_proj_z (output gate)
            + 2 * 2 * d_model * text["linear_num_value_heads"]  # in_proj_b, in_proj_a
            + 2 * values * d_model)  # out_proj


def lm_projection_flops_per_token(config: dict) -> int:
    """Every linear layer of the language model for one token (what nn.Linear hooks count), no output head."""
    return sum(_projection_flops(config, kind) for kind in layer_kinds(config))


def lm_flops(config: dict, length: int, layers: range | None = None) -> int:
    """The language model's prefill of `length` tokens, in `layers` (default: all of them)."""
    text = _text(config)
    kinds = layer_kinds(config)
    flops = 0
    for kind in (kinds[i] for i in (layers if layers is not None else range(len(kinds)))):
        flops += _projection_flops(config, kind) * length
        if kind == "full_attention":
            flops += 2 * 2 * length * length * text["num_attention_heads"] * _head_dim(text)  # Q K^T and A V
        else:
            flops += 2 * text["linear_conv_kernel_dim"] * _gdn_channels(text) * length  # depthwise causal conv
            flops += 6 * text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * length
    return flops


def cache_bytes(config: dict, length: int, dtype_bytes: int = 2, state_dtype_bytes: int = 4, layers: range | None = None) -> tuple[int, int]:
    """(keys + values of the full-attention layers, GDN conv + recurrent states) for `length` tokens, in `layers`
    (default: all of them)."""
    text = _text(config)
    kinds = layer_kinds(config)
    kv, state = 0, 0
    for kind in (kinds[i] for i in (layers if layers is not None else range(len(kinds)))):
        if kind == "full_attention":
            kv += 2 * length * text["num_key_value_heads"] * _head_dim(text) * dtype_bytes
        else:
            state += _gdn_channels(text) * text["linear_conv_kernel_dim"] * dtype_bytes  # transformers keeps K columns
            state += text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * state_dtype_bytes
    return kv, state


def vision_projection_flops(config: dict, grid_thw: tuple[int, int, int]) -> int:
    """Patch embedding, every block's linear layers and the projector for one image (what module hooks count); the
    block MLP and the projector's layout are the family's (core/families.py)."""
    family = family_of_config(config)
    vision = config["vision_config"]
    patches = grid_thw[0] * grid_thw[1] * grid_thw[2]
    merge = vision["spatial_merge_size"]
    width = vision["hidden_size"]
    inner = vision.get("intermediate_size") or 4 * width
    out = vision.get("out_hidden_size") or _text(config)["hidden_size"]
    pixels_per_patch = vision.get("in_channels", 3) * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    flops = 2 * pixels_per_patch * width * patches  # patch embedding (a Conv3d with stride = kernel)
    mlp = {"fc": 2 * 2 * width * inner, "swiglu": 2 * 3 * width * inner, "swiglu_out": 2 * 3 * width * out}[family.vision_mlp]
    block = 2 * width * 3 * width + 2 * width * width + mlp  # qkv, output projection, MLP
    flops += vision["depth"] * block * patches
    merged = patches // merge**2
    hidden = width * merge**2
    if family.merged_by == "conv_glu":  # strided Conv2d (merge x merge patches -> out), then proj out x out and a SwiGLU of width inner
        return flops + merged * (2 * hidden * out + 2 * out * out + 2 * 3 * out * inner)
    mergers = 1 + len(vision.get("deepstack_visual_indexes") or [])
    flops += mergers * merged * (2 * hidden * hidden + 2 * hidden * out)
    return flops


def vision_attention_flops(config: dict, grid_thw: tuple[int, int, int]) -> int:
    """Q K^T and A V of every vision block for one image or clip: each temporal patch attends within itself (the vision
    tower's sequence boundaries), Qwen2.5-VL's windowed blocks within windows."""
    vision = config["vision_config"]
    t, h, w = grid_thw
    width = vision["hidden_size"]
    full = t * 4 * (h * w) ** 2 * width
    if not family_of_config(config).windowed_vision:
        return vision["depth"] * full
    merge = vision["spatial_merge_size"]
    side = vision["window_size"] // merge // vision["patch_size"]  # window side in merged tokens
    mh, mw = h // merge, w // merge
    windows = [
        min(side, mh - r) * min(side, mw - c) * merge**2 for r in range(0, mh, side) for c in range(0, mw, side)
    ]
    windowed = t * sum(4 * n * n * width for n in windows)
    full_blocks = len(vision.get("fullatt_block_indexes") or [])
    return full_blocks * full + (vision["depth"] - full_blocks) * windowed


# Text a clip adds to a prompt per clip layout (core/families.py): (per clip, per temporal patch). Qwen3: `<t seconds>`
# (~6 tokens), vision start and end per patch; GLM-4V: image start and end and the whole seconds (~1 token) per patch,
# the video's start and end once; Qwen2.5-VL: vision start and end around the one run.
CLIP_TEXT_TOKENS = {"stamp_before": (0, 8), "stamp_after": (2, 3), "one_run": (2, 0)}


def clip_text_tokens(config: dict, patches: int) -> int:
    """Text tokens a clip of `patches` temporal patches adds to a prompt of the config's family."""
    per_clip, per_patch = CLIP_TEXT_TOKENS[family_of_config(config).clip_layout]
    return (per_clip + per_patch * patches) if patches else 0

MERGE_HIDDEN = 64  # the learnable token merge's head width (models/token_merge.py)


def merge_parameters(config: dict) -> int:
    dim = _text(config)["hidden_size"]
    return MERGE_HIDDEN * 2 * dim + 2 * MERGE_HIDDEN  # input weight [64, 2D] and bias, output weight [1, 64]


def merge_flops(config: dict, n: int, k: int) -> int:
    """One image's learnable token merge: N x K cosines, the head on the N tokens and the K kept ones."""
    if k == n:
        return 0  # everything kept: nothing to merge
    dim = _text(config)["hidden_size"]
    return 2 * n * k * dim + 2 * (n + k) * dim * MERGE_HIDDEN + 2 * n * MERGE_HIDDEN


def prefill_cost(config: dict, text_tokens: int, image_grids: list[tuple[int, int, int]], budget_bps: int, k_min: int,
                 dtype_bytes: int = 2, state_dtype_bytes: int = 4, token_merge: bool = False, pruned_after: int | None = None) -> PrefillCost:
    """Cost of one prompt: `text_tokens` text tokens and images of patch grids (t, h, w), at `budget_bps`.
    `pruned_after` (FastV: its scoring layer + 1): the layers before it see every visual token and the scoring layer
    adds its last query's row of scores (2 L H d); None: the selector prunes before the language model."""
    merge = config["vision_config"]["spatial_merge_size"]
    visual = [t * h * w // merge**2 for t, h, w in image_grids]
    kept_per_image = [tokens_to_keep(n, budget_bps, k_min) for n in visual]
    kept = sum(kept_per_image)
    length = text_tokens + kept
    vision = sum(vision_projection_flops(config, g) + vision_attention_flops(config, g) for g in image_grids)
    merging = sum(merge_flops(config, n, k) for n, k in zip(visual, kept_per_image)) if token_merge else 0
    if pruned_after is None or kept == sum(visual):
        kv, state = cache_bytes(config, length, dtype_bytes, state_dtype_bytes)
        return PrefillCost(length, kept, lm_flops(config, length), vision, kv, state, merging)
    text, layers, full = _text(config), len(layer_kinds(config)), text_tokens + sum(visual)
    early, late = range(pruned_after), range(pruned_after, layers)
    flops = lm_flops(config, full, early) + 2 * full * text["num_attention_heads"] * _head_dim(text) + lm_flops(config, length, late)
    caches = [cache_bytes(config, n, dtype_bytes, state_dtype_bytes, part) for n, part in ((full, early), (length, late))]
    return PrefillCost(full, kept, flops, vision, sum(kv for kv, _ in caches), sum(state for _, state in caches), merging)


def fastv_cut(config: dict) -> int:
    """The first layer of this config.json's language model that FastV's pruning reaches (its scoring layer + 1)."""
    return scoring_layer(config) + 1


def patch_grid(config: dict, height: int, width: int) -> tuple[int, int, int]:
    """Patch grid (1, h, w) of an image whose sides are rounded to multiples of patch x merge (no min/max_pixels bounds)."""
    vision = config["vision_config"]
    unit = vision["patch_size"] * vision["spatial_merge_size"]
    return 1, max(1, round(height / unit)) * vision["spatial_merge_size"], max(1, round(width / unit)) * vision["spatial_merge_size"]
