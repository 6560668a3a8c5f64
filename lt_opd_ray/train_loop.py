"""Data order for training: seeded epochs, fixed-size batches, a cursor that can be resumed."""

from __future__ import annotations

import random
from collections.abc import Iterator

from .data import Sample, stable_seed


def epoch_order(count: int, shuffle_seed: int, epoch: int) -> list[int]:
    order = list(range(count))
    random.Random(stable_seed("epoch", shuffle_seed, epoch)).shuffle(order)
    return order


def batches(samples: list[Sample], batch_size: int, shuffle_seed: int, cursor: int = 0) -> Iterator[list[Sample]]:
    """Endless batches; `cursor` counts samples already consumed, so a resumed run continues exactly."""
    if batch_size > len(samples):
        raise ValueError(f"prompts_per_step ({batch_size}) exceeds the {len(samples)} samples in the data")
    while True:
        epoch, offset = divmod(cursor, len(samples))
        order = epoch_order(len(samples), shuffle_seed, epoch)
        if offset + batch_size <= len(samples):
            picked = order[offset : offset + batch_size]
        else:  # a batch never straddles epochs: the epoch's tail is skipped, not dropped silently from counting
            cursor = (epoch + 1) * len(samples)
            continue
        cursor += batch_size
        yield [samples[i] for i in picked]
