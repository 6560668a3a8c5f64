"""Data order for training: seeded epochs, fixed-size batches, a cursor that can be resumed."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.seeding import stable_seed


def epoch_order(count: int, shuffle_seed: int, epoch: int) -> list[int]:
    order = list(range(count))
    random.Random(stable_seed("epoch", shuffle_seed, epoch)).shuffle(order)
    return order


def batches(samples: list[Sample], batch_size: int, shuffle_seed: int, cursor: int = 0) -> Iterator[list[Sample]]:
    """Endless batches over the stream epoch 0's order, epoch 1's order, ...

    `cursor` counts samples already consumed, so a resumed run continues exactly.
    A batch may span two epochs: every sample is seen once per epoch, none is dropped.
    """
    if not 1 <= batch_size <= len(samples):
        raise ValueError(f"prompts_per_step ({batch_size}) must lie in [1, {len(samples)}], the samples in the data")
    order_of = functools.lru_cache(maxsize=2)(lambda epoch: epoch_order(len(samples), shuffle_seed, epoch))
    while True:
        positions = (divmod(p, len(samples)) for p in range(cursor, cursor + batch_size))
        cursor += batch_size
        yield [samples[order_of(epoch)[offset]] for epoch, offset in positions]
