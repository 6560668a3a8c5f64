"""DAPO's dynamic sampling, as the driver and the reference both run it: a prompt whose n responses all get the same
reward has zero advantages, so no gradient; its slot in the update is given a fresh training row, sampled again, up
to `reward.dynamic_sampling_rounds` times (a slot still flat after the last round keeps its group: it adds nothing to
the gradient and the update keeps its size). Ray-free and torch-free.

A replacement row is drawn uniformly from the training rows by a generator seeded with (data.shuffle_seed, update,
slot, round), passing over rows already in the update (while any row is not): the epoch order and its cursor are
untouched, and a resumed run draws the same rows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.seeding import stable_seed


def is_flat(rewards: Sequence[float]) -> bool:
    """Whether a prompt's responses all got the same reward (its group's advantages are all 0)."""
    return max(rewards) == min(rewards)


def draw_replacements(rows: Sequence[Sample], shuffle_seed: int, update: int, round_: int, batch: Sequence[Sample],
                      slots: Sequence[int]) -> dict[int, Sample]:
    """A new row for each of `slots` (positions in `batch`, the update's rows) in round `round_` (1, 2, ...): each
    drawn uniformly from `rows`, slot by slot in ascending order, passing over the rows of `batch` and those drawn
    before it while any row is left."""
    taken = {s.uid for s in batch}
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
