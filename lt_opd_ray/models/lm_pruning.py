"""Pruning inside the language model (FastV, core/selectors/fastv.py): every visual token enters the first layers, the
scoring layer's attention chooses, and the layers after it see the kept visual tokens beside every text token.

- The scoring layer (`core.fastv_layers.scoring_layer`: K - 1, or the first full-attention layer from there)
  has its attention read where every family hands it over: transformers' attention interface receives each layer's
  normalised, rotated q and k, and for the scoring layer's one call `probe_attention` computes
  softmax(q_last k^T * scale + mask), averaged over the heads, for the last query row only, then runs the model's own
  kernel (nothing [L, L] is held).
- The layers run in two ranges over one cache (`run_layers`): up to the scoring layer over the whole prompt, after it
  over shorter rows (kept visual tokens at their full-sequence M-RoPE positions, text as it was, the left padding
  redone). Each range builds its own masks, sized against its own layers' cache (`create_causal_mask(layer_idx=...)`):
  the first layers' cache holds every prompt token, the later layers' the kept ones, and decoding appends to both.
- Qwen3-VL's deepstack features enter layers 0-2 at every visual token before the cut and at the kept ones after it;
  linear-attention layers after the cut run their recurrence over the kept tokens alone, as over a shorter prompt.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import sys

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lt_opd_ray.core.fastv_layers import layer_types, scoring_layer
from lt_opd_ray.models.adapter import PaddedBatch, QwenVLM, ReducedPrompt
from lt_opd_ray.models.transfer import to_device

PROBE = "lt_opd_last_query_probe"  # the attention implementation the scoring layer runs under for one call
_probe = contextvars.ContextVar("probe", default=None)  # (the implementation it wraps, where the scores go)
MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask,
         "linear_attention": create_recurrent_attention_mask}


def last_query_attention(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """[B, keys]: softmax(q k^T * scale + mask) of each row's last query over its keys, averaged over the heads, in
    fp32. query [B, heads, L, d]; key [B, kv heads, keys, d] (each serving heads / kv heads query heads, read in place:
    no repeated copy); the mask as the layer's kernel gets it (boolean: True attends; floating: added; None: every key)."""
    rows, heads, _, dim = query.shape
    groups = heads // key.shape[1]
    q = query[:, :, -1].float().reshape(rows, key.shape[1], groups, dim)  # query head h reads key head h // groups
    logits = (q @ key.float().transpose(-1, -2)).flatten(1, 2) * (scaling if scaling is not None else dim**-0.5)  # [B, heads, keys]
    if attention_mask is not None:
        if attention_mask.ndim != 4:
            raise ValueError(f"fastv's probe reads a [B, 1, queries, keys] attention mask (sdpa, eager); this attention"
                             f" implementation hands it a {attention_mask.ndim}-D one: load the model with sdpa")
        row = attention_mask[:, :, -1, -key.shape[2]:]  # [B, 1, keys]
        logits = logits.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else logits + row.float()
    return torch.softmax(logits, dim=-1).mean(dim=1)


def probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The scoring layer's attention: records `last_query_attention`, then runs the implementation it wraps."""
    wrapped, record = _probe.get()
    record.append(last_query_attention(query, key, attention_mask, scaling))
    eager = sys.modules[type(module).__module__].eager_attention_forward  # the family's own, as its layers fall back to
    kernel = ALL_ATTENTION_FUNCTIONS.get_interface(wrapped, eager)
    return kernel(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(PROBE, probe_attention)


@contextlib.contextmanager
def probing(attention, record: list):
    """For calls of `attention` (a layer's attention module) inside: `probe_attention` around its own kernel. The
    switch is on the text config every layer reads: one forward of the model at a time (the server holds its lock)."""
    config = attention.config
    wrapped = config._attn_implementation
    token = _probe.set((wrapped, record))
    config._attn_implementation_internal = PROBE  # the text config alone: its own sub-configs are none
    try:
        yield
    finally:
        config._attn_implementation_internal = wrapped
        _probe.reset(token)


def run_layers(vlm: QwenVLM, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, layers: range,
               deepstack: list[torch.Tensor] | None = None, visual: torch.Tensor | None = None,
               record: list | None = None) -> torch.Tensor:
    """Decoder layers `layers` of the language model over hidden [B, L, D] (no final norm). `mask` [B, cached + L]: 1
    at this range's real tokens, cached ones first; `positions` [4, B, L]: seq index, then M-RoPE (t, h, w); `cache`
    gains these layers' keys and values (or states); `deepstack`: per layer index, the features added at `visual`
    [B, L] after that layer; `record`: the last layer's attention of each row's last query is appended to it."""
    text = vlm.language_model
    types = layer_types(text.config)
    seq_index = positions[0]
    masks = {}
    for index in layers:  # one mask per kind of layer, sized against the first of its kind in this range
        kind = types[index]
        if kind not in masks:
            sized = {} if kind == "linear_attention" else {"layer_idx": index}
            masks[kind] = MASKS[kind](config=text.config, inputs_embeds=hidden, attention_mask=mask, past_key_values=cache,
                                      position_ids=seq_index, **sized)
    rotary = text.rotary_emb(hidden, positions[1:])
    for index in layers:
        layer = text.layers[index]
        with probing(layer.self_attn, record) if record is not None and index == layers[-1] else contextlib.nullcontext():
            hidden = layer(hidden, attention_mask=masks[types[index]], position_ids=seq_index, past_key_values=cache,
                           use_cache=True, position_embeddings=rotary)
        if deepstack is not None and index < len(deepstack):
            hidden = text._deepstack_process(hidden, visual, deepstack[index])
    return hidden


class PrunedInside:
    """Prefill and decoding of left-padded prompts that prune inside the language model (`ReducedPrompt.inside`): the
    sampler's language-model side (models/sampler.py), as `PlainDecoding` is for prompts pruned before it."""

    def __init__(self, vlm: QwenVLM, prompts: list[ReducedPrompt]):
        if not all(p.inside is not None for p in prompts):
            raise ValueError("a batch prunes inside the language model in every prompt or in none")
        self.vlm, self.prompts = vlm, prompts
        self.cut = scoring_layer(vlm.language_model.config) + 1  # layers [0, cut) see every token, [cut, layers) the kept ones
        self.layers = vlm.language_model.config.num_hidden_layers
        self.cache = DynamicCache(config=vlm.language_model.config)
        self.selected: list[list[torch.Tensor]] = []  # per prompt, per visual unit: the kept indices

    def prefill(self) -> torch.Tensor:
        """[B, D]: the final hidden state at each row's last prompt token."""
        batch = self.vlm.pad_batch(self.prompts)
        record: list[torch.Tensor] = []
        hidden = run_layers(self.vlm, batch.inputs_embeds, batch.attention_mask, batch.position_ids, self.cache,
                            range(self.cut), batch.deepstack, batch.visual_pos_masks, record)
        keep = self._choose(batch, record[0])
        late = self._kept(batch, hidden, keep)
        self.masks = [batch.attention_mask, late.attention_mask]
        self.lengths = [batch.attention_mask.sum(-1), late.attention_mask.sum(-1)]
        hidden = run_layers(self.vlm, late.inputs_embeds, late.attention_mask, late.position_ids, self.cache,
                            range(self.cut, self.layers), late.deepstack, late.visual_pos_masks)
        return self.vlm.language_model.norm(hidden)[:, -1]

    def step(self, ids: list[int], step: int) -> torch.Tensor:
        """[B, D]: the final hidden state after each row's next token `ids[b]` (the response's `step`-th, from 0)."""
        vlm, rows = self.vlm, len(ids)
        hidden = vlm.embed_tokens(torch.tensor(ids, dtype=torch.long))[:, None]
        rope = torch.tensor([p.next_position + step for p in self.prompts], device=vlm.device)  # the full sequence's M-RoPE
        for part, layers in enumerate((range(self.cut), range(self.cut, self.layers))):
            self.masks[part] = torch.cat([self.masks[part], self.masks[part].new_ones(rows, 1)], dim=1)
            positions = torch.stack([self.lengths[part] + step, rope, rope, rope])[:, :, None]  # seq index: this range's rows
            hidden = run_layers(vlm, hidden, self.masks[part], positions, self.cache, layers)
        return vlm.language_model.norm(hidden)[:, -1]

    def _choose(self, batch: PaddedBatch, scores: torch.Tensor) -> torch.Tensor:
        """[B, L] True at each row's text tokens and the visual tokens its selector keeps by `scores` [B, L]."""
        keep = batch.attention_mask.bool() & ~batch.visual_pos_masks
        for b, prompt in enumerate(self.prompts):
            inside = prompt.inside
            columns = batch.visual_pos_masks[b].nonzero().flatten()  # the row's visual tokens, unit after unit
            sizes = [embeds.shape[0] for embeds in inside.features.embeds]
            ranked = dataclasses.replace(inside.features, language_attention=list(scores[b, columns].cpu().split(sizes)))
            selected = self.vlm.select(inside.prompt, ranked, inside.selector, inside.budget_bps, inside.k_min, inside.seed)
            kept = torch.cat([indices + start for indices, start in zip(selected, itertools.accumulate(sizes, initial=0))])
            keep[b, columns[to_device(kept, columns.device)]] = True
            self.selected.append(selected)
        return keep

    def _kept(self, batch: PaddedBatch, hidden: torch.Tensor, keep: torch.Tensor) -> PaddedBatch:
        """The rows cut to their `keep` columns (hidden states after the scoring layer), left-padded again."""
        rows, device = hidden.shape[0], hidden.device
        columns = [keep[b].nonzero().flatten() for b in range(rows)]
        width = max(c.numel() for c in columns)
        embeds = hidden.new_zeros(rows, width, hidden.shape[-1])
        mask = torch.zeros(rows, width, dtype=torch.long, device=device)
        positions = torch.zeros(4, rows, width, dtype=torch.long, device=device)
        visual = torch.zeros(rows, width, dtype=torch.bool, device=device)
        for b, kept in enumerate(columns):
            pad = width - kept.numel()
            embeds[b, pad:] = hidden[b, kept]
            mask[b, pad:] = 1
            positions[0, b, pad:] = torch.arange(kept.numel(), device=device)  # seq index over the shorter row
            positions[1:, b, pad:] = batch.position_ids[1:, b, kept]  # full-sequence M-RoPE
            visual[b, pad:] = batch.visual_pos_masks[b, kept]
        deepstack = None
        if batch.deepstack is not None:  # its rows are every visual token, row after row: keep the kept ones
            kept_visual = torch.cat([keep[b][batch.visual_pos_masks[b]] for b in range(rows)])
            deepstack = [layer[kept_visual] for layer in batch.deepstack]
        return PaddedBatch(embeds, mask, positions, visual, deepstack)
