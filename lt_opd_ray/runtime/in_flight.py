"""One update's submitted work, as the driver holds it between submitting it and training on it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lt_opd_ray.core.samples import Sample
from lt_opd_ray.runtime.rollout_pool import GroupRef


@dataclass
class InFlight:
    """One update's submitted work: its prompts and its rollout groups (ObjectRefs); each group's learner rank asks
    the teacher to score it."""

    update: int
    budget_bps: int
    batch: list[Sample]
    samples_ref: object  # ref to `batch`
    groups: list[GroupRef]
    replaced: Counter[int] = field(default_factory=Counter)  # per worker: replacements started inside this update
    drawn: dict[int, str] = field(default_factory=dict)  # dynamic sampling: per prompt slot given a new row, that row's uid
    resampled: int = 0  # dynamic sampling: flat groups replaced by a new row's
    flat: int = 0  # dynamic sampling: groups still flat after the last round, left out of the step
