"""The attention each merged visual token receives inside a transformers vision tower (HiPrune's scores,
core/selectors/hiprune.py), recorded during the tower's own forward.

A forward pre-hook on the attention module of the two recorded blocks takes what the block hands it (its normed
hidden states, the segment bounds `cu_seqlens`, the rotary cos/sin), recomputes q and k with the module's own `qkv`
projection and its family's rotary function, and scores them segment by segment (`received_attention`): the tower
itself keeps running its fused kernel (sdpa, flash), which never materialises the attention matrix. The extra cost
is two blocks' q/k projections and QK^T, a block of query rows at a time.

Every family here (core/families.py) orders its patches so that the `merge**2` patches one merged token folds are
consecutive; Qwen2.5-VL's windowed tower runs its blocks on a window-permuted order of those groups, undone here.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from lt_opd_ray.core.selectors import EncoderAttention
from lt_opd_ray.core.selectors.hiprune import received_attention, recorded_blocks


@contextlib.contextmanager
def recorded_attention(visual) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within: each forward of `visual` (a family's vision tower) appends, for its object block and its last block
    (`recorded_blocks`), the [patches] attention each patch receives, in the order the blocks hold the patches."""
    blocks = recorded_blocks(len(visual.blocks))
    record: dict[int, list[torch.Tensor]] = {b: [] for b in blocks}
    rotary = getattr(sys.modules[type(visual.blocks[0].attn).__module__], "apply_rotary_pos_emb_vision", None)
    if rotary is None:
        raise ValueError(f"{type(visual).__name__}: its module has no apply_rotary_pos_emb_vision; HiPrune cannot recompute its attention")

    def recorder(index: int):
        def record_block(module, args, kwargs) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            length = hidden.shape[0]
            with torch.no_grad():
                query, key, _ = module.qkv(hidden).reshape(length, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
                query, key = rotary(query, key, *kwargs["position_embeddings"])
                record[index].append(received_attention(query.transpose(0, 1), key.transpose(0, 1), kwargs["cu_seqlens"].tolist()))
        return record_block

    handles = [visual.blocks[b].attn.register_forward_pre_hook(recorder(b), with_kwargs=True) for b in dict.fromkeys(blocks)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def tower_attention(visual, record: dict[int, list[torch.Tensor]], grid_thw: torch.Tensor, merge: int, windowed: bool) -> EncoderAttention:
    """One transformers tower call's record (`recorded_attention`) as per merged token, in the merger's output order."""
    if any(len(calls) != 1 for calls in record.values()):
        raise RuntimeError(f"{type(visual).__name__}: expected one tower forward, recorded {[len(c) for c in record.values()]}")
    window_index = None
    if windowed:
        from transformers.vision_utils import get_vision_window_index

        window_index, _ = get_vision_window_index(grid_thw, spatial_merge_size=merge, window_size=visual.window_size,
                                                  patch_size=visual.patch_size)
    object_block, last_block = (record[b][0] for b in recorded_blocks(len(visual.blocks)))
    return merged_attention(object_block, last_block, merge, window_index)


def merged_attention(object_block: torch.Tensor, last_block: torch.Tensor, merge: int, window_index: torch.Tensor | None) -> EncoderAttention:
    """Per-patch attention (in the order the blocks held the patches) as per merged token, in the merger's output
    order: a windowed tower's permutation undone (its blocks held merge group window_index[g] at slot g), then each
    token's `merge**2` patches averaged."""
    groups = merge * merge
    object_block, last_block = object_block.view(-1, groups), last_block.view(-1, groups)
    if window_index is not None:
        order = torch.argsort(window_index.to(object_block.device))
        object_block, last_block = object_block[order], last_block[order]
    return EncoderAttention(object_block.mean(dim=1), last_block.mean(dim=1))
