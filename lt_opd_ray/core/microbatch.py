"""Token-budgeted micro-batches for the learner and the teacher (pure Python, no torch).

A rank's share of an update is far larger than one forward can hold (docs/scale.md:
~320 sequences x ~1,150 positions per rank at the paper's shapes), so it runs as
micro-batches whose computed size stays within a token budget, with gradients
accumulated into the update's one optimizer step: `rows x longest sequence` for
left-padded rows, the sum of the sequences' tokens for a packed row (`packed`:
the sequences end to end, models/packing.py).

Packing keeps the n responses of a prompt together, because they share one
vision-tower forward (the learner) or one prompt cache (the teacher): prompts are
taken longest-first and each prompt's sequences longest-first, so sequences of
similar length share a micro-batch (length bucketing) and a prompt spans several
micro-batches only when its group does not fit in what is left of the current one.
A single sequence longer than the budget gets a micro-batch of its own: the
budget bounds every other micro-batch, and that one holds exactly one sequence.

The streaming learner feeds its groups to a `Packer` in prompt order as they
arrive (it cannot sort a set it has not seen yet); `pack` sorts a whole set first.
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
    computed_tokens: int  # what the forward computes: rows x longest sequence padded, the sequences' tokens packed


class Packer:
    """Greedy packing of sequences fed one prompt group at a time: `add` returns the micro-batches it closed.

    A micro-batch closes when the next sequence would take it past the budget, so the
    packing depends only on the order of the groups fed, never on when they arrive.
    `packed`: the budget counts the sequences' tokens (one packed row), not rows x longest.
    """

    def __init__(self, token_budget: int, packed: bool = False):
        if token_budget < 1:
            raise ValueError(f"token budget must be >= 1, got {token_budget}")
        self.token_budget, self.packed = token_budget, packed
        self.current: list[Sequence] = []
        self.longest = 0

    def add(self, group: list[Sequence]) -> list[MicroBatch]:
        """Feed one prompt's sequences (longest first, so similar lengths share a micro-batch)."""
        closed = []
        for seq in sorted(group, key=lambda s: (-s.tokens, s.index)):
            width = max(self.longest, seq.tokens)
            if self.current and self.computed([*self.current, seq], width) > self.token_budget:
                closed.append(self.close())
                width = seq.tokens
            self.current.append(seq)
            self.longest = width
        return closed

    def computed(self, sequences: list[Sequence], longest: int) -> int:
        return sum(s.tokens for s in sequences) if self.packed else len(sequences) * longest

    def close(self) -> MicroBatch:
        current = sorted(self.current, key=lambda s: s.index)  # the caller's order within a batch: the cost is the same either way
        prompts = tuple(dict.fromkeys(s.prompt for s in current))
        batch = MicroBatch(tuple(s.index for s in current), prompts, self.computed(current, self.longest))
        self.current, self.longest = [], 0
        return batch

    def flush(self) -> list[MicroBatch]:
        return [self.close()] if self.current else []


def pack(sequences: list[Sequence], token_budget: int, packed: bool = False) -> list[MicroBatch]:
    """Length-bucketed packing of a whole set: prompts longest-first, each prompt's sequences longest-first."""
    by_prompt: dict[int, list[Sequence]] = {}
    for seq in sequences:
        by_prompt.setdefault(seq.prompt, []).append(seq)
    packer = Packer(token_budget, packed)
    batches = []
    for group in sorted(by_prompt.values(), key=lambda group: (-max(s.tokens for s in group), group[0].prompt)):
        batches += packer.add(group)
    return batches + packer.flush()


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of near-equal size (the first ones one larger)."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for p in range(parts):
        stop = start + base + (1 if p < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def mini_batch_of(prompts: list[int], steps: int) -> dict[int, int]:
    """Each of a learner rank's prompts (in prompt order) -> its mini-batch, the optimizer step that trains on it: the
    rank's prompts in `steps` consecutive near-equal parts (`split_evenly`)."""
    return {prompts[i]: k for k, (start, stop) in enumerate(split_evenly(len(prompts), steps)) for i in range(start, stop)}


def update_mini_batches(prompts: int, ranks: int, steps: int) -> list[list[int]]:
    """An update's prompts by mini-batch across the learner ranks: mini-batch k is every rank's k-th
    (`mini_batch_of` of each rank's share, `split_evenly(prompts, ranks)`)."""
    batches: list[list[int]] = [[] for _ in range(steps)]
    for start, stop in split_evenly(prompts, ranks):
        for prompt, k in mini_batch_of(list(range(start, stop)), steps).items():
            batches[k].append(prompt)
    return batches
