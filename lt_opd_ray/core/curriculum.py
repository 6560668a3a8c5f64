"""The visual-budget curriculum and the per-image token rule (docs/architecture.md §1).

Budgets are integer basis points (bps) so that the schedule is exact and
comparable across machines: 2500 bps = 25% of an image's visual tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BPS = 10_000  # budgets are integer basis points: 500 bps = 5% of the visual tokens


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


@dataclass(frozen=True)
class BudgetSchedule:
    """r(c) for c = optimizer steps completed before the update, from the job's `budget` (config.BudgetConfig, whose
    defaults are the paper's: start 2500, target 500, warm_steps 14, decay_end 100: 25% for c <= 13, cosine decay
    for 14 <= c <= 99, 5% from c = 100 on). No-curriculum ablation: start_bps = target_bps. No final hold:
    decay_end = the run's last update.
    """

    start_bps: int
    target_bps: int
    warm_steps: int
    decay_end: int

    def __post_init__(self) -> None:
        for name in ("start_bps", "target_bps"):
            value = getattr(self, name)
            if not 0 < value <= BPS:
                raise ValueError(f"{name} = {value} bps is outside (0, {BPS}]: a budget must lie in (0, 1]")
        if self.target_bps > self.start_bps:
            raise ValueError(f"target_bps ({self.target_bps}) exceeds start_bps ({self.start_bps})")
        if not 0 <= self.warm_steps <= self.decay_end:
            raise ValueError(f"need 0 <= warm_steps ({self.warm_steps}) <= decay_end ({self.decay_end})")

    @classmethod
    def from_config(cls, budget) -> BudgetSchedule:
        return cls(
            start_bps=budget.start_bps,
            target_bps=budget.target_bps,
            warm_steps=budget.warm_steps,
            decay_end=budget.decay_end,
        )

    def budget_bps(self, step: int) -> int:
        if step < 0:
            raise ValueError(f"curriculum step must be >= 0, got {step}")
        last_warm = self.warm_steps - 1  # 13 in the paper: the cosine phase is anchored there
        if step <= last_warm:
            return self.start_bps
        if step >= self.decay_end:
            return self.target_bps
        span = self.decay_end - last_warm  # 87 in the paper
        half_range = (self.start_bps - self.target_bps) / 2
        # r(c) = target + (start - target)/2 * (1 + cos(pi * (c - 13) / 87))
        return round_half_up(self.target_bps + half_range * (1 + math.cos(math.pi * (step - last_warm) / span)))


def tokens_to_keep(n_tokens: int, budget_bps: int, k_min: int) -> int:
    """k = min(N, max(k_min, ceil(N * r))), with r = budget_bps / 10000, in exact integers."""
    if n_tokens < 1:
        raise ValueError(f"an image must have at least one visual token, got N = {n_tokens}")
    if not 0 < budget_bps <= BPS:
        raise ValueError(f"budget {budget_bps} bps is outside (0, {BPS}]: a budget must lie in (0, 1]")
    if k_min < 1:
        raise ValueError(f"k_min must be >= 1, got {k_min}")
    ceil_share = -(-n_tokens * budget_bps // BPS)  # ceil(N * bps / 10000) without floating point
    return min(n_tokens, max(k_min, ceil_share))
