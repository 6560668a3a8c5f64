"""The paper's RL baselines as losses: group-relative advantages and the clipped policy-gradient objectives of GRPO,
DAPO and GSPO (Ray-free; tests/test_rl.py checks values and gradients against per-sequence loops).

Shapes: `logprobs`, `old_logprobs`, `mask` are [B, T] (B responses, right-padded to T; `mask` 1 on response
tokens), `advantages` is [B] (one per response). `old_logprobs` are the policy that sampled the responses, as the
rollout engine reported them; `logprobs` the learner's, with gradients.
"""

from __future__ import annotations

from typing import Literal

import torch

PolicyLoss = Literal["grpo", "dapo", "gspo"]
# Each paper's clip range (1 - low, 1 + high) on its ratio: PPO's symmetric 0.2; DAPO's "clip-higher"; GSPO's on a
# sequence's length-normalised ratio, which stays much closer to 1 than a token's.
CLIP_RANGES: dict[str, tuple[float, float]] = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}
TOKEN_MEAN = ("dapo",)  # the losses averaged over the batch's response tokens; the others over its responses
# verl's bounds on a log-ratio before its exp (no gradient where one bites): a token's both ways; GSPO's sequence
# mean from above. One token the engine sampled at a far lower log-prob than the learner's would otherwise overflow.
LOG_RATIO_LIMIT = 20.0
SEQUENCE_LOG_RATIO_LIMIT = 10.0


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Each reward minus its group's mean, over groups of `group_size` consecutive responses (one prompt's); divided
    by the group's standard deviation (unbiased, as torch.std) plus eps when `scale` (GRPO), not divided when not
    (Dr. GRPO). A group whose rewards are all equal gets zero advantages either way."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size).float()
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:  # a group of one has no spread: its advantage is 0 either way
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def sequence_terms(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                   kind: PolicyLoss, clip_low: float, clip_high: float, dual_clip: float | None) -> torch.Tensor:
    """Each response's part of the loss before the batch's normalisation ([B]): the loss is their sum divided by the
    batch's responses (grpo, gspo) or by its response tokens (dapo: `TOKEN_MEAN`), so micro-batches of one update
    add up to the update's loss when each divides by the update's count.

    grpo: the mean over the response's tokens of -min(r A, clip(r, 1 - low, 1 + high) A), r = exp(logprobs - old),
    the log-ratio clamped to ±LOG_RATIO_LIMIT; where A < 0 the term is at most `dual_clip` |A| (None: no cap).
    dapo: the same per-token term summed over its tokens (a long response weighs by its length).
    gspo: -min(s A, clip(s) A), s = exp(mean over its tokens of logprobs - old) clamped above at
    exp(SEQUENCE_LOG_RATIO_LIMIT), one ratio per response; no dual clip (as verl's GSPO: its clip range is narrow).
    """
    if kind not in CLIP_RANGES:
        raise ValueError(f"unknown policy loss {kind!r}: one of grpo, dapo, gspo")
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).masked_fill(mask == 0, 0.0)  # padding may hold -inf log-probs: no nan through it
    lengths = mask.sum(dim=1)  # every response has a token: the callers check (on the host, reading nothing back)
    if kind == "gspo":
        ratio = torch.exp(((log_ratio * mask).sum(dim=1) / lengths).clamp(max=SEQUENCE_LOG_RATIO_LIMIT))  # [B]
        return -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    a = advantages[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    if dual_clip is not None:  # -c A = c |A| where A < 0: a stale token's ratio no longer scales its push down
        per_token = torch.where(a < 0, torch.minimum(per_token, -dual_clip * a), per_token)
    return (per_token * mask).sum(dim=1) / (1.0 if kind in TOKEN_MEAN else lengths)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                kind: PolicyLoss, clip_low: float, clip_high: float, dual_clip: float | None) -> torch.Tensor:
    """The scalar loss to minimise over one batch: `sequence_terms` summed, over its responses (grpo, gspo: a mean of
    per-response means) or its response tokens (dapo: a token mean)."""
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"response(s) {empty} have no tokens under the mask")
    terms = sequence_terms(logprobs, old_logprobs, advantages, mask, kind=kind, clip_low=clip_low, clip_high=clip_high,
                           dual_clip=dual_clip)
    return terms.sum() / (mask.sum() if kind in TOKEN_MEAN else len(terms))
