"""Token-budgeted micro-batches for the learner and the teacher (pure Python, no torch).

A rank's share of an update is far larger than one forward can hold (docs/scale.md:
~320 sequences x ~1,150 positions per rank at the paper's shapes), so it runs as
micro-batches whose padded size `rows x longest sequence` stays within a token
budget, with gradients accumulated into the update's one optimizer step.

Packing keeps the n responses of a prompt together, because they share one
vision-tower forward (the learner) or one prompt cache (the teacher): prompts are
taken longest-first and each prompt's sequences longest-first, so sequences of
similar length share a micro-batch (length bucketing) and a prompt spans several
micro-batches only when its group does not fit in what is left of the current one.
A single sequence longer than the budget gets a micro-batch of its own: the
budget bounds every other micro-batch, and that one holds exactly one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sequence:
    """One sequence to pack: its position in the caller's list, its prompt and its length in tokens."""

    index: int
    prompt: int
    tokens: int


@dataclass(frozen=True)
class MicroBatch:
    sequences: tuple[int, ...]  # indices into the caller's list, ascending
    prompts: tuple[int, ...]  # prompts with at least one sequence here, in first-seen order
    padded_tokens: int  # rows x longest sequence: what the forward allocates


def pack(sequences: list[Sequence], token_budget: int) -> list[MicroBatch]:
    """Greedy length-bucketed packing into micro-batches of at most `token_budget` padded tokens."""
    if token_budget < 1:
        raise ValueError(f"token budget must be >= 1, got {token_budget}")
    by_prompt: dict[int, list[Sequence]] = {}
    for seq in sequences:
        by_prompt.setdefault(seq.prompt, []).append(seq)
    groups = sorted(by_prompt.values(), key=lambda group: (-max(s.tokens for s in group), group[0].prompt))
    ordered = [s for group in groups for s in sorted(group, key=lambda s: (-s.tokens, s.index))]
    batches, current, longest = [], [], 0
    for seq in ordered:
        width = max(longest, seq.tokens)
        if current and (len(current) + 1) * width > token_budget:
            batches.append(_close(current, longest))
            current, width = [], seq.tokens
        current.append(seq)
        longest = width
    if current:
        batches.append(_close(current, longest))
    return batches


def _close(current: list[Sequence], longest: int) -> MicroBatch:
    current = sorted(current, key=lambda s: s.index)  # the caller's order within a batch: padding is the same either way
    prompts = tuple(dict.fromkeys(s.prompt for s in current))
    return MicroBatch(tuple(s.index for s in current), prompts, len(current) * longest)


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of near-equal size (the first ones one larger)."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for p in range(parts):
        stop = start + base + (1 if p < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
