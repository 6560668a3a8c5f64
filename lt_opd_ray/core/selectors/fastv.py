"""FastV (Chen et al., ECCV 2024, arXiv 2403.06764, "An Image is Worth 1/2 Tokens After Layer 2"): training-free
pruning inside the language model.

Every visual token enters the language model; at layer K - 1 the attention the prompt's last token pays each visual
token, softmax over the whole prompt and averaged over the heads, ranks them, and layers K and up see the k best
(ties toward the lower index) beside every text token. K = 2 in its release. The scores exist only inside the
language model's forward, so the selection runs there (models/lm_pruning.py) and the pruning follows it.

The scoring layer is K - 1; where the language model mixes in linear-attention layers (Qwen3.5's Gated DeltaNet,
which has no attention weights to rank by), the first full-attention layer at or after K - 1 (Qwen3.5-4B: layer 3 of
32, so its layers 4-31 see the kept tokens). A language model with no layer after it has nothing to prune in: refused.
"""

from __future__ import annotations

import torch

from lt_opd_ray.core.selectors.base import SelectionInput, Selector

FASTV_LAYER = 2  # K: the release's default; layers 0 .. K-1 see every visual token


class FastV(Selector):
    name = "fastv"
    prunes_inside_language_model = True

    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        scores = item.language_attention.float()
        return torch.sort(-scores, stable=True).indices[:k]  # the most attended; equal scores: the lower index first


def layer_types(config) -> list[str]:
    """Each decoder layer's kind in a language model's config (every layer full attention where it names none)."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def scoring_layer(config) -> int:
    """0-based: the layer of the language model (its text config) whose attention ranks the visual tokens; pruning
    follows it. A ValueError where no such layer has a layer after it."""
    types = layer_types(config)
    index = next((i for i in range(FASTV_LAYER - 1, len(types)) if types[i] == "full_attention"), None)
    if index is None:
        raise ValueError(f"fastv: the language model has no full-attention layer at or after layer {FASTV_LAYER - 1} to rank visual tokens by")
    if index + 1 >= len(types):
        raise ValueError(f"fastv: the language model has {len(types)} layers and FastV ranks at layer {index} (0-based): no layer"
                         " after it sees the pruned prompt")
    return index
