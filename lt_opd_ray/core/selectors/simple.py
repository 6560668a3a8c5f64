"""Baseline selectors that ignore the content: seeded random and uniform grid."""

from __future__ import annotations

import torch

from lt_opd_ray.core.selectors.base import SelectionInput, Selector


class RandomSelector(Selector):
    """k tokens uniformly without replacement; the same seed gives the same set."""

    name = "random"

    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(item.seed)
        return torch.randperm(item.features.shape[0], generator=generator)[:k]


class UniformGridSelector(Selector):
    """One token from the centre of each of k equal strata of the raster order.

    On an h x w grid this spreads the kept tokens evenly over rows and, within the
    stride, over columns; with k = N it keeps everything.
    """

    name = "uniform"

    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        n = item.features.shape[0]
        # stratum s covers [s*N/k, (s+1)*N/k); its centre is floor((2s+1)*N / 2k), distinct for k <= N
        strata = torch.arange(k, dtype=torch.long)
        return ((2 * strata + 1) * n) // (2 * k)
