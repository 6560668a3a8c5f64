"""DAPO's dynamic sampling, as the driver and the reference both run it: a prompt whose n responses all get the same
reward (after the overlong punishment: the reward the advantages see) has zero advantages, so no gradient; its slot in
the update is given a fresh training row, sampled again, up to `reward.dynamic_sampling_rounds` times (a slot still
flat after the last round is left out of the step: no loss and no place in its normaliser, DAPO's filter,
models/loss.group_policy_inputs). Ray-free and torch-free.

Each slot's replacement rows, one per round, are reserved before any is needed (`reserve_rows`): a row is drawn
uniformly from the training rows by a generator seeded with (data.shuffle_seed, update, slot, round), passing over the
rows the update samples (its own, and those reserved before it) while any row is left. So a slot's chain of rows does
not depend on when the other slots' groups finish: the driver moves a slot on as soon as its own group is judged, and
the reference, round by round, gets the same rows. The reserved rows are extra views: the epoch order and its cursor
are untouched, and a resumed run reserves the same rows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.seeding import stable_seed


def is_flat(rewards: Sequence[float]) -> bool:
    """Whether a prompt's responses all got the same reward (its group's advantages are all 0)."""
    return max(rewards) == min(rewards)


def reserve_rows(rows: Sequence[Sample], shuffle_seed: int, update: int, sampled: set[str], slots: Sequence[int],
                 rounds: int) -> dict[int, list[Sample]]:
    """Per slot of `slots` (positions in the update's rows), its replacement rows for rounds 1..`rounds`: slot by slot
    in ascending order, round by round, each drawn uniformly from `rows` with the (seed, update, slot, round)
    generator, passing over the uids in `sampled` (the update's own rows) and those reserved before it while any row
    is left; once every row is taken, rows repeat."""
    taken = set(sampled)
    left = len({r.uid for r in rows} - taken)
    reserved: dict[int, list[Sample]] = {}
    for slot in sorted(slots):
        reserved[slot] = []
        for round_ in range(1, rounds + 1):
            rng = random.Random(stable_seed("dynamic-sampling", shuffle_seed, update, slot, round_))
            row = rows[rng.randrange(len(rows))]
            while left and row.uid in taken:
                row = rows[rng.randrange(len(rows))]
            if row.uid not in taken:
                taken.add(row.uid)
                left -= 1
            reserved[slot].append(row)
    return reserved
