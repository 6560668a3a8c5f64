"""CDPruner for Qwen-style VLMs (docs/architecture.md §1): conditional DPP, greedy MAP.

Kernel L = diag(rho) V V^T diag(rho) + eps I over L2-normalised visual tokens V,
with relevance rho_i = cos(V_i, q) min-max normalised to [1e-6, 1] (all ones, pure
diversity, when the cosines spread by no more than 1e-6: float32 noise, as the
reference implementation treats it). Greedy MAP
uses the incremental-Cholesky fast greedy algorithm (Chen et al., 2018), computing
one kernel row per pick: O(N*D + N*k) memory, never the N x N kernel.
"""

from __future__ import annotations

import torch

from lt_opd_ray.core.selectors.base import SelectionInput, Selector

KERNEL_RIDGE = 1e-6
RELEVANCE_FLOOR = 1e-6
FLAT_SPREAD = 1e-6  # cosines this close are float32 noise: no relevance signal


def relevance(unit_features: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
    """rho in [1e-6, 1]: cosine of L2-normalised tokens to the query, min-max normalised; flat (or no query) -> 1.
    Decided on the device (no value read back): the selection runs inside an engine's prefill."""
    if query is None:
        return torch.ones(unit_features.shape[0], dtype=torch.float32, device=unit_features.device)
    q = torch.nn.functional.normalize(query.float(), dim=-1)
    cos = unit_features @ q  # not negated: both sides live in the LLM embedding space
    spread = cos.max() - cos.min()
    scaled = ((cos - cos.min()) / spread.clamp(min=FLAT_SPREAD)).clamp(RELEVANCE_FLOOR, 1.0)
    return torch.where(spread <= FLAT_SPREAD, torch.ones_like(cos), scaled)


def greedy_dpp_map(unit_features: torch.Tensor, rho: torch.Tensor, k: int) -> torch.Tensor:
    """Pick k indices maximising log det L_S greedily; ties go to the lowest index. Every pick stays on the device
    (the chosen index is a tensor, the exhausted case a mask): k picks read nothing back to the host."""
    n = unit_features.shape[0]
    cholesky_rows = unit_features.new_zeros(k, n)  # c_i stacked: row t holds e_t for every item
    gains = rho * rho + KERNEL_RIDGE  # d_i^2 = L_ii, the marginal gain of log det before any pick
    picked = torch.empty(k, dtype=torch.long, device=unit_features.device)
    available = torch.ones(n, dtype=torch.bool, device=unit_features.device)
    for t in range(k):
        # the pick as a one-element index tensor: indexing by a 0-dim tensor reads it on the host (a sync on a GPU)
        j = torch.argmax(torch.where(available, gains, -torch.inf)).reshape(1)  # the first maximum: ties to the lowest index
        picked[t : t + 1] = j
        available.index_fill_(0, j, False)
        gain_j = gains.index_select(0, j)
        # numerically exhausted (no item adds volume): the remaining picks follow index order, no Cholesky row
        exhausted = gain_j <= 0
        row_j = unit_features.index_select(0, j)[0]
        kernel_row = rho.index_select(0, j) * rho * (unit_features @ row_j)  # L_{j,:} computed on the fly
        kernel_row = kernel_row.index_add(0, j, kernel_row.new_full((1,), KERNEL_RIDGE))
        # e_i = (L_ji - <c_j, c_i>) / d_j ; then d_i^2 -= e_i^2
        e = (kernel_row - cholesky_rows[:t].T @ cholesky_rows[:t].index_select(1, j)[:, 0]) / torch.sqrt(torch.where(exhausted, 1.0, gain_j))
        e = torch.where(exhausted, torch.zeros_like(e), e)
        cholesky_rows[t] = e
        gains = torch.where(exhausted, torch.where(available, torch.zeros_like(gains), gains), gains - e * e)
    return picked


class CDPruner(Selector):
    name = "cdpruner"

    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        unit = torch.nn.functional.normalize(item.features.float(), dim=-1)
        return greedy_dpp_map(unit, relevance(unit, item.query), k)
