"""DAPO's dynamic sampling, as the driver and the reference both run it: a prompt whose n responses all get the same
reward (after the overlong punishment: the reward the advantages see) has zero advantages, so no gradient; its slot in
the update is given a fresh training row, sampled again, up to `reward.dynamic_sampling_rounds` times (a slot still
flat after the last round keeps its group: it adds nothing to the gradient and the update keeps its size). Ray-free and
torch-free.

A replacement row is drawn uniformly from the training rows by a generator seeded with (data.shuffle_seed, update,
slot, round), passing over the rows the update has already sampled (its own and those drawn in earlier rounds: sampled
again they would give the same responses, seeded by update and row) while any row is left. The drawn rows are extra
views: the epoch order and its cursor are untouched, and a resumed run draws the same rows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.seeding import stable_seed


def is_flat(rewards: Sequence[float]) -> bool:
    """Whether a prompt's responses all got the same reward (its group's advantages are all 0)."""
    return max(rewards) == min(rewards)


def draw_replacements(rows: Sequence[Sample], shuffle_seed: int, update: int, round_: int, tried: set[str],
                      slots: Sequence[int]) -> dict[int, Sample]:
    """A new row for each of `slots` (positions in the update's rows) in round `round_` (1, 2, ...): each drawn
    uniformly from `rows`, slot by slot in ascending order, passing over the uids in `tried` (every row the update has
    sampled so far) and those drawn before it while any row is left."""
    taken = set(tried)
    left = len({r.uid for r in rows} - taken)
    drawn = {}
    for slot in sorted(slots):
        rng = random.Random(stable_seed("dynamic-sampling", shuffle_seed, update, slot, round_))
        row = rows[rng.randrange(len(rows))]
        while left and row.uid in taken:
            row = rows[rng.randrange(len(rows))]
        if row.uid not in taken:
            taken.add(row.uid)
            left -= 1
        drawn[slot] = row
    return drawn
