"""HiPrune (Liu et al., 2025, arXiv 2508.00553): training-free selection from the vision encoder's own attention.

The encoder's middle blocks attend to the objects, its deep blocks spread attention over tokens that summarise the
image. Of the k kept tokens:
- anchors: the a = round(alpha * k / 5) tokens receiving the most attention at the object block (the encoder's
  middle block, `object_block`);
- buffers: each anchor's 4-neighbours on the merged grid (above, left, right, below, inside the grid), anchors in
  rank order, until k tokens are chosen;
- registers: the rest of k, the tokens receiving the most attention at the encoder's last block among those not yet
  chosen.
Ranks break ties toward the lower index. alpha = 0.1 and the middle block are the release's settings for Qwen2.5-VL
(its object layer 16 of 32). The release clamps a neighbour's flat index into [0, N) and so wraps a row's ends and
adds token 0 or N-1 beside an edge anchor; here a neighbour is a grid neighbour. With alpha 0.1 an anchor appears
once k >= 25 (at 5% of 500 tokens): below that HiPrune keeps the last block's most attended tokens.

The attention a token receives is computed by `received_attention`, one segment of queries at a time
(models/encoder_attention.py records it inside the encoder's forward).
"""

from __future__ import annotations

import torch

from lt_opd_ray.core.selectors.base import SelectionInput, Selector

ALPHA = 0.1  # share of the budget spent on anchors and their buffers (a = alpha * k / 5 anchors, up to 4 buffers each)
OBJECT_DEPTH = 0.5  # the object block: this share of the encoder's depth (block 16 of 32, 1-based, in Qwen2.5-VL-3B)
SCORE_ELEMENTS = 1 << 24  # attention probabilities held at once while scoring (64 MiB of fp32)


def recorded_blocks(depth: int) -> tuple[int, int]:
    """0-based (object block, last block) of an encoder with `depth` blocks."""
    if depth < 1:
        raise ValueError(f"a vision encoder of {depth} blocks has no attention to read")
    return max(1, round(depth * OBJECT_DEPTH)) - 1, depth - 1


def received_attention(query: torch.Tensor, key: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """[S] the attention each position receives: within each segment [bounds[i], bounds[i+1]) (an image, or a window
    of a windowed block), softmax(q k^T / sqrt(d)) over the segment's keys, averaged over the heads and summed over
    the segment's queries. query, key: [H, S, d] after the block's rotary embedding. Computed a block of query rows
    at a time (never the S x S matrix), in fp32."""
    heads, length, dim = query.shape
    query, key = query.float(), key.float()
    received = query.new_zeros(length)
    for lo, hi in zip(bounds, bounds[1:]):
        keys = key[:, lo:hi]
        rows = max(1, SCORE_ELEMENTS // (heads * (hi - lo)))
        for start in range(lo, hi, rows):
            logits = query[:, start : min(start + rows, hi)] @ keys.transpose(1, 2) * dim**-0.5  # [H, rows, hi - lo]
            received[lo:hi] += logits.softmax(dim=-1).sum(dim=(0, 1)) / heads
    return received


def _ranked(score: torch.Tensor) -> torch.Tensor:
    """Indices by score, highest first; equal scores in index order."""
    return torch.sort(score, descending=True, stable=True).indices


class HiPrune(Selector):
    name = "hiprune"
    reads_encoder_attention = True

    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"hiprune: alpha {alpha} is outside [0, 1]")
        self.alpha = alpha

    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        n = item.features.shape[0]
        height, width = item.grid_hw
        if height * width != n:
            raise ValueError(f"hiprune: grid {height} x {width} does not hold N = {n} tokens")
        anchors = _ranked(item.attention.object_block.float().cpu())[: round(self.alpha * k / 5)]
        row, col = anchors // width, anchors % width
        # each anchor's neighbours above, left, right, below; off-grid ones marked -1
        around = torch.stack([torch.where(row > 0, anchors - width, -1), torch.where(col > 0, anchors - 1, -1),
                              torch.where(col < width - 1, anchors + 1, -1), torch.where(row < height - 1, anchors + width, -1)], dim=1)
        seen = set(anchors.tolist())
        order = []  # buffers, anchor by anchor in rank order, first seen first
        for j in around.flatten().tolist():
            if j >= 0 and j not in seen:
                seen.add(j)
                order.append(j)
        picked = torch.cat([anchors, torch.tensor(order, dtype=torch.long)])[:k]
        chosen = torch.zeros(n, dtype=torch.bool)  # on the host, as the scores were put: selection is metadata
        chosen[picked] = True
        last = _ranked(item.attention.last_block.float().cpu())
        registers = last[~chosen[last]][: k - picked.numel()]
        return torch.cat([picked, registers])
