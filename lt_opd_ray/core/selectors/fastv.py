"""FastV (Chen et al., ECCV 2024, arXiv 2403.06764, "An Image is Worth 1/2 Tokens After Layer 2"): training-free
pruning inside the language model.

Every visual token enters the language model; at layer K - 1 the attention the prompt's last token pays each visual
token, softmax over the whole prompt and averaged over the heads, ranks them, and layers K and up see the k best
(ties toward the lower index) beside every text token. K = 2 in its release. The scores exist only inside the
language model's forward, so the selection runs there (models/lm_pruning.py) and the pruning follows it. Which layer scores,
and where none may: core/fastv_layers.py.
"""

from __future__ import annotations

import torch

from lt_opd_ray.core.selectors.base import SelectionInput, Selector


class FastV(Selector):
    name = "fastv"
    prunes_inside_language_model = True

    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        scores = item.language_attention.float()
        return torch.sort(-scores, stable=True).indices[:k]  # the most attended; equal scores: the lower index first

