"""The attention each merged visual token receives inside vLLM's vision tower (HiPrune's scores), recorded during the
tower's own forward, as models/encoder_attention.py does for transformers' towers.

vLLM's towers (Qwen3.5 and Qwen3-VL through Qwen2.5-VL's attention class, Qwen2.5-VL, GLM-4V) hand each block's
`MMEncoderAttention` the rotated query and key ([1, S, heads, head_dim]) and the segment bounds `cu_seqlens`: a
forward pre-hook there scores them (`received_attention`, a block of query rows at a time) while the tower runs its
own kernel. Under tensor parallelism a rank holds only its share of the heads (its q has fewer than the tower's), and
under FlashInfer `cu_seqlens` are the backend's byte offsets: both are refused by name rather than scored wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lt_opd_ray.core.selectors import EncoderAttention
from lt_opd_ray.core.selectors.hiprune import received_attention, recorded_blocks
from lt_opd_ray.models.encoder_attention import merged_attention


@contextlib.contextmanager
def recorded_attention(visual, heads: int) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within: each forward of vLLM's tower `visual` (of `heads` attention heads) appends, for its object block and
    last block, the [patches] attention each patch receives, in the order the blocks hold the patches."""
    blocks = recorded_blocks(len(visual.blocks))
    record: dict[int, list[torch.Tensor]] = {b: [] for b in blocks}
    for b in dict.fromkeys(blocks):
        if "FLASHINFER" in str(getattr(visual.blocks[b].attn.attn, "attn_backend", "")).upper():
            raise ValueError("hiprune on vLLM: the FlashInfer vision backend passes its own cu_seqlens offsets; choose another mm_encoder_attn_backend")

    def recorder(index: int):
        def record_block(module, args, kwargs) -> None:
            query, key = kwargs["query"], kwargs["key"]  # [1, S, heads, head_dim], rotated
            if query.shape[2] != heads:  # the rank holds a share of the heads: its scores would not be the tower's
                raise ValueError(f"hiprune on vLLM: this rank's vision tower holds {query.shape[2]} of its {heads} heads"
                                 " (tensor parallel); serve it with tensor_parallel_size 1")
            bounds = kwargs["cu_seqlens"].tolist()
            with torch.no_grad():
                record[index].append(received_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), bounds))
        return record_block

    handles = [visual.blocks[b].attn.attn.register_forward_pre_hook(recorder(b), with_kwargs=True) for b in dict.fromkeys(blocks)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def tower_attention(visual, record: dict[int, list[torch.Tensor]], grid_thw: list[list[int]], merge: int, windowed: bool) -> EncoderAttention:
    """One vLLM tower call's record as per merged token, in the merger's output order (its images end to end)."""
    if any(len(calls) != 1 for calls in record.values()):
        raise RuntimeError(f"{type(visual).__name__}: expected one tower forward, recorded {[len(c) for c in record.values()]}")
    window_index = visual.prepare_encoder_metadata(grid_thw)["window_index"] if windowed else None
    object_block, last_block = (record[b][0] for b in recorded_blocks(len(visual.blocks)))
    return merged_attention(object_block, last_block, merge, window_index)
