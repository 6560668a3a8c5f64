"""Results that cross a role boundary, as typed records both sides import (this module imports no role)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LearnerStepResult:
    """One learner rank's part of an update's optimizer step."""

    loss: float  # Σ over this rank's sequences of their token-mean loss / (N / ranks): the mean over ranks is the update's loss
    divergence: float  # token-mean over this rank's tokens
    importance_weight: float  # token-mean
    top_k_overlap: float  # token-mean
    tokens: int
    sequences: int
    prompts: int
    micro_batches: int  # forward/backward passes with sequences
    filler_micro_batches: int  # zero-weighted passes that keep the ranks' backward counts equal
    vision_forwards: int
    grad_norm: float  # global, before clipping: the same on every rank
    seconds: float = 0.0  # compute only, not the wait for rollouts and payloads
    teacher_seconds: float = 0.0  # the slowest teacher request this rank's payloads came from
    payload_bytes: int = 0
    payload_tokens: int = 0
