"""DivPrune (Alvar et al., 2025): max-min diversity over cosine distance.

First pick: the token farthest from its nearest neighbour; then repeatedly the
token whose distance to the closest already-picked token is largest. Distances
are computed one picked row at a time (plus a chunked first pass), never N x N.
"""

from __future__ import annotations

import torch

from lt_opd_ray.core.selectors.base import SelectionInput, Selector

FIRST_PASS_CHUNK = 1024


def _nearest_neighbour_distance(unit: torch.Tensor) -> torch.Tensor:
    n = unit.shape[0]
    nearest = torch.empty(n, dtype=unit.dtype, device=unit.device)
    for start in range(0, n, FIRST_PASS_CHUNK):
        distance = 1.0 - unit[start : start + FIRST_PASS_CHUNK] @ unit.T  # cosine distance
        rows = torch.arange(distance.shape[0], device=unit.device)
        distance[rows, rows + start] = torch.inf  # a token is not its own neighbour
        nearest[start : start + FIRST_PASS_CHUNK] = distance.min(dim=1).values
    return nearest


class DivPrune(Selector):
    name = "divprune"

    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        unit = torch.nn.functional.normalize(item.features.float(), dim=-1)
        n = unit.shape[0]
        picked = torch.empty(k, dtype=torch.long)
        if n == 1:
            return torch.zeros(1, dtype=torch.long)
        score = _nearest_neighbour_distance(unit)
        for t in range(k):
            j = int(torch.argmax(score).item())
            picked[t] = j
            if t == 0:
                score = 1.0 - unit @ unit[j]  # from now on: distance to the closest picked token
            else:
                score = torch.minimum(score, 1.0 - unit @ unit[j])
            score[picked[: t + 1]] = -torch.inf
        return picked
