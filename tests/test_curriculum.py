import math

import pytest

from lt_opd_ray.config.schema import BudgetConfig
from lt_opd_ray.core.curriculum import BudgetSchedule, tokens_to_keep

PAPER = BudgetSchedule.from_config(BudgetConfig())  # the job schema's defaults are the paper's


def schedule(**changes) -> BudgetSchedule:
    return BudgetSchedule(**{"start_bps": 2500, "target_bps": 500, "warm_steps": 14, "decay_end": 100, **changes})


@pytest.mark.parametrize(
    "step, bps",
    [(0, 2500), (13, 2500), (14, 2499), (57, 1482), (99, 501), (100, 500), (174, 500)],
)
def test_paper_schedule_pinned(step, bps):
    assert PAPER.budget_bps(step) == bps


def test_schedule_matches_the_formula_written_out():
    for c in range(175):
        if c <= 13:
            expected = 2500
        elif c <= 99:
            expected = math.floor(500 + 1000 * (1 + math.cos(math.pi * (c - 13) / 87)) + 0.5)
        else:
            expected = 500
        assert PAPER.budget_bps(c) == expected, c


def test_schedule_is_monotone_non_increasing():
    values = [PAPER.budget_bps(c) for c in range(175)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_no_curriculum_ablation_is_target_from_step_zero():
    flat = schedule(start_bps=500, target_bps=500)
    assert {flat.budget_bps(c) for c in range(175)} == {500}


def test_no_final_hold_ablation_decays_until_the_end():
    no_hold = schedule(decay_end=175)
    assert no_hold.budget_bps(100) > 500
    assert no_hold.budget_bps(175) == 500


@pytest.mark.parametrize(
    "n, bps, k_min, k",
    [
        (4096, 500, 32, 205),  # ceil(204.8) = 205
        (4096, 2500, 32, 1024),
        (100, 500, 32, 32),  # k_min floor
        (16, 500, 32, 16),  # capped at N
        (16, 10000, 1, 16),
        (16, 500, 1, 1),  # ceil(0.8) = 1
        (20, 500, 1, 1),  # exactly 1.0
        (21, 500, 1, 2),  # ceil(1.05) = 2
    ],
)
def test_per_image_k_rule(n, bps, k_min, k):
    assert tokens_to_keep(n, bps, k_min) == k


def test_k_rule_brute_force():
    for n in range(1, 300, 7):
        for bps in (1, 37, 500, 1482, 2500, 9999, 10000):
            for k_min in (1, 4, 32):
                share = n * bps / 10000
                expected = min(n, max(k_min, math.ceil(share - 1e-12)))
                assert tokens_to_keep(n, bps, k_min) == expected


@pytest.mark.parametrize("bps", [0, -5, 10001])
def test_budget_outside_unit_interval_is_refused(bps):
    with pytest.raises(ValueError, match=r"outside \(0, 10000\]"):
        tokens_to_keep(64, bps, 4)
    with pytest.raises(ValueError, match="start_bps"):
        schedule(start_bps=bps, target_bps=min(500, max(bps, 1)))


def test_bad_schedule_parameters_are_refused():
    with pytest.raises(ValueError, match="exceeds start_bps"):
        schedule(start_bps=500, target_bps=2500)
    with pytest.raises(ValueError, match="k_min"):
        tokens_to_keep(64, 500, 0)
