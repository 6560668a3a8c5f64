"""One interface for visual-token selectors.

A selector sees one image's post-merger visual embeddings (N x D), the query
embedding (D), the image's merged grid (h, w) and, for a selector that reads them
(`reads_encoder_attention`), the attention each merged token receives inside the
vision encoder, or (`prunes_inside_language_model`: FastV) the attention the prompt's
last token pays each of them inside the language model; it returns the sorted indices
of the k tokens the student keeps. Where the pruning happens is the selector's: before
the language model (the reduced prompt holds the kept tokens only) or inside it, after
the layer whose attention ranked them (models/lm_pruning.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncoderAttention:
    """The attention each merged token receives inside the vision encoder (models/encoder_attention.py): at a block,
    softmax(q k^T / sqrt(d)) over each attention segment, averaged over heads, summed over the queries, averaged over
    the patches the merger folds into the token."""

    object_block: torch.Tensor  # [N] at the encoder's middle block (HiPrune's object-centric layer)
    last_block: torch.Tensor  # [N] at its last block (HiPrune's global layer)

    def __post_init__(self) -> None:
        if self.object_block.shape != self.last_block.shape or self.object_block.ndim != 1:
            raise ValueError(f"encoder attention: expected two [N] tensors, got {tuple(self.object_block.shape)} and {tuple(self.last_block.shape)}")


@dataclass(frozen=True)
class SelectionInput:
    features: torch.Tensor  # [N, D] post-merger visual embeddings of one image
    query: torch.Tensor | None  # [D] mean input embedding of the question tokens
    grid_hw: tuple[int, int]  # merged token grid; N = h * w (times t for video)
    seed: int = 0  # per-sample seed, used only by stochastic selectors
    attention: EncoderAttention | None = None  # given where the selector reads it (Selector.reads_encoder_attention)
    language_attention: torch.Tensor | None = None  # [N] what the prompt's last token pays each token inside the LM (FastV)


class Selector(abc.ABC):
    name: str
    scope: str = "image"  # what one budget covers (selectors/__init__.py SCOPES); the adapter applies it
    reads_encoder_attention: bool = False  # its caller runs the vision encoder recording EncoderAttention
    prunes_inside_language_model: bool = False  # it ranks by the LM's own attention: every token enters, the pruning follows

    def select(self, item: SelectionInput, k: int) -> torch.Tensor:
        n = item.features.shape[0]
        if item.features.ndim != 2:
            raise ValueError(f"{self.name}: features must be [N, D], got shape {tuple(item.features.shape)}")
        if not 1 <= k <= n:
            raise ValueError(f"{self.name}: cannot keep k = {k} of N = {n} visual tokens (need 1 <= k <= N)")
        if self.reads_encoder_attention and item.attention is None:
            raise ValueError(f"{self.name} reads the vision encoder's attention, which this path did not record")
        if self.prunes_inside_language_model and item.language_attention is None:
            raise ValueError(f"{self.name} ranks by the language model's attention, which only a forward pruning inside it records")
        if item.language_attention is not None and item.language_attention.shape != (n,):
            raise ValueError(f"{self.name}: language-model attention of shape {tuple(item.language_attention.shape)}, features for {n} tokens")
        if item.attention is not None and item.attention.last_block.shape[0] != n:
            raise ValueError(f"{self.name}: encoder attention for {item.attention.last_block.shape[0]} tokens, features for {n}")
        with torch.no_grad():
            indices = self._select(item, k)
        return torch.sort(indices.to(torch.long).cpu()).values  # indices are metadata: recorded, shipped, replayed

    @abc.abstractmethod
    def _select(self, item: SelectionInput, k: int) -> torch.Tensor:
        """Return k distinct indices in [0, N), in any order."""
