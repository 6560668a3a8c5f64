"""One interface for visual-token selectors.

A selector sees one image's post-merger visual embeddings (N x D), the query
embedding (D) and the image's merged grid (h, w), and returns the sorted indices
of the k tokens the student keeps.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectionInput:
    features: torch.Tensor  # [N, D] post-merger visual embeddings of one image
    query: torch.Tensor | None  # [D] mean input embedding of the question tokens
    grid_hw: tuple[int, int]  # merged token grid; N = h * w (times t for video)
    seed: int = 0  # per-sample seed, used only by stochastic selectors


class Selector(abc.ABC):
    name: str
    scope: str = "image"  # what one budget covers (selectors/__init__.py SCOPES); the adapter applies it

    def select(self, item: SelectionInput, k: int) -> torch.Tensor:
        n = item.features.shape[0]
        if item.features.ndim != 2:
            raise ValueError(f"{self.name}: features must be [N, D], got shape {tuple(item.features.shape)}")
        if not 1 <= k <= n:
            raise ValueError(f"{self.name}: cannot keep k = {k} of N = {n} visual tokens (need 1 <= k <= N)")
        with torch.no_grad():
            indices = self._select(item, k)
        return torch.sort(indices.to(torch.long).cpu()).values  # indices are metadata: recorded, shipped, replayed

    @abc.abstractmethod
    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        """Return k distinct indices in [0, N), in any order."""
