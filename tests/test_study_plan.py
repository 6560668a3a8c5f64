"""A pre-registered contrast's verdict (`tools/study_plan.py`) against computations written here from the formulas: the
statistic from made-up runs by hand, the paired t-test from the t table and `statistics`, each decision the plan's
rule can reach, and the plan file's refusals."""

from __future__ import annotations

import math
import statistics

import pytest

from lt_opd_ray.models.evaluation import Evaluation
from lt_opd_ray.tools.study_plan import StudyPlan, critical_t, load_plan, paired_test, power, t_cdf, verdict, write_verdict

TEACHER = {kind: {"full": full, "cdpruner": full / 2} for kind, full in (("biggest", 0.9), ("smallest", 0.8), ("top", 0.75), ("left", 0.6))}


def plan(**changes) -> StudyPlan:
    data = {"job": "jobs/toy_discs.yaml", "out": "runs/x", "contrast": ["lt_opd", "grpo"], "seeds": 4, "updates": 320, "eval_rows": "toy-discs-test:2048",
            "eval_every": 40, "statistic": {"kinds": ["biggest", "smallest", "top"], "held_out_kinds": ["left"], "last": 3},
            "decision": {"alpha": 0.05, "minimal_effect": 0.02, "expected_sd": 0.028}}
    for key, value in changes.items():
        data[key] = value
    return StudyPlan.model_validate(data)


def run(arm: str, seed: int, levels: list[float]) -> dict:
    """A run whose evaluation e (every 40 updates) has accuracy `levels[e]` times the teacher's on each kind, but
    0.3 on `left`; curve entries between evaluations carry none."""
    curve = []
    for e, level in enumerate(levels):
        curve.append({"step": 40 * e + 39, "eval": {}, "loss": 0.1, "reward": 0.5})
        by_kind = {"cdpruner": {k: level * TEACHER[k]["full"] for k in ("biggest", "smallest", "top")} | {"left": 0.3},
                   "divprune": {k: 0.0 for k in TEACHER}}
        curve.append({"step": 40 * e + 40, "loss": 0.1, "reward": 0.5, "eval": {}, "eval_by_kind": by_kind})
    return {"arm": arm, "seed": seed, "curve": curve}


def results(a_levels: list[list[float]], b_levels: list[list[float]]) -> dict:
    return {"teacher_by_kind": TEACHER, "runs": [run("lt_opd", s, lv) for s, lv in enumerate(a_levels)] + [run("grpo", s, lv) for s, lv in enumerate(b_levels)]}


FLAT = [0.5, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]


def test_the_statistic_is_the_mean_retain_over_the_trained_kinds_of_the_last_evaluations_and_the_held_out_kind_apart():
    levels = [0.1, 0.2, 0.3, 0.4, 0.5, 0.61, 0.62, 0.66]  # retain on each trained kind = level: the last three average 0.63
    a = [[*levels[:-1], levels[-1] + 0.01 * s] for s in range(4)]
    out = verdict(results(a, [FLAT] * 4), plan())
    by_hand = [statistics.fmean([0.61, 0.62, 0.66 + 0.01 * s]) for s in range(4)]
    assert out["lt_opd"]["statistic"] == pytest.approx(by_hand, abs=1e-12)
    assert out["lt_opd"]["held_out"] == pytest.approx([0.3 / 0.6] * 4)  # beside it, never in it
    assert out["grpo"]["statistic"] == pytest.approx([0.6] * 4)


def test_the_paired_test_is_the_t_tables():
    assert critical_t(7, 0.05) == pytest.approx(1.894579, abs=1e-5)  # the t table's values
    assert critical_t(2, 0.025) == pytest.approx(4.302653, abs=1e-5)
    assert critical_t(30, 0.05) == pytest.approx(1.697261, abs=1e-5)
    assert 1 - t_cdf(2.998, 7) == pytest.approx(0.01, abs=2e-5) and t_cdf(-1.0, 3) == pytest.approx(1 - t_cdf(1.0, 3), abs=1e-12)
    a, b = [0.70, 0.66, 0.69, 0.64, 0.71], [0.65, 0.64, 0.66, 0.62, 0.66]
    test = paired_test(a, b, 0.05)
    diffs = [x - y for x, y in zip(a, b)]
    assert test["mean"] == pytest.approx(statistics.fmean(diffs)) and test["sd"] == pytest.approx(statistics.stdev(diffs))
    assert test["t"] == pytest.approx(statistics.fmean(diffs) / (statistics.stdev(diffs) / math.sqrt(5)))
    assert test["df"] == 4 and test["critical_t"] == pytest.approx(2.131847, abs=1e-5)
    low, high = test["interval"]
    assert (low + high) / 2 == pytest.approx(test["mean"]) and high - low == pytest.approx(2 * 2.131847 * test["se"], rel=1e-5)


@pytest.mark.parametrize("shift, spread, decision", [
    (0.05, 0.01, "shown"),        # every pair above by about 0.05: t far past the critical value
    (0.0, 0.01, "not shown"),
    (-0.05, 0.01, "reversed"),
    (0.004, 0.001, "shown"),      # small but consistent: the pairs' own spread decides, not a fixed threshold
])
def test_each_decision_the_rule_can_reach(shift, spread, decision):
    """Curves flat after their first evaluation (every seed's level its own), the arms apart by `shift`."""
    b = [[0.5] + [0.6 + spread * (s % 2)] * 7 for s in range(4)]
    a = [[0.5] + [0.6 + shift + spread * ((s + 1) % 3)] * 7 for s in range(4)]
    out = verdict(results(a, b), plan())
    assert out["decision"] == decision, out["test"]


def test_no_verdict_without_every_seed_or_on_a_curve_that_still_climbs_and_a_small_effect_can_be_ruled_out():
    data = results([FLAT] * 3, [FLAT] * 4)
    assert verdict(data, plan())["decision"] == "no verdict" and "lt_opd seed 3" in verdict(data, plan())["why"]
    climbing = [[0.1 * e + 0.01 * s for e in range(8)] for s in range(4)]
    out = verdict(results(climbing, [FLAT] * 4), plan())
    assert out["decision"] == "no verdict" and "not flat by the plan's rule: lt_opd" in out["why"]
    same = [[0.5] + [0.6 + 0.001 * s] * 7 for s in range(4)]
    out = verdict(results(same, [FLAT] * 4), plan())
    assert out["decision"] == "not shown" and out["ruled_out"]  # the interval lies below the minimal effect of 0.02


def test_the_plans_power_is_its_level_at_no_effect_and_grows_with_the_seeds():
    at_zero = power(plan(decision={"alpha": 0.05, "minimal_effect": 1e-9, "expected_sd": 0.028}))
    assert at_zero == pytest.approx(0.05, abs=0.003)  # the test's level: the critical value is the t table's
    few, many = power(plan(seeds=4)), power(plan(seeds=16))
    # d/sd = 0.71 with 16 pairs: the noncentral t (noncentrality 2.86, 15 df, critical 1.753) passes 0.853 of the time
    # by its normal approximation Φ((2.86 - 1.753) / sqrt(1 + 1.753² / 30))
    assert few < many and many == pytest.approx(0.853, abs=0.015)


def test_the_plan_file_is_refused_by_field_and_the_verdict_written_from_it(tmp_path):
    (tmp_path / "bad.yaml").write_text("job: j\nout: o\ncontrast: [a, a]\nseeds: 8\nupdates: 320\neval_rows: r\neval_every: 40\n"
                                       "statistic: {kinds: [x]}\ndecision: {minimal_effect: 0.02, expected_sd: 0.03}\n")
    with pytest.raises(ValueError, match=f"{tmp_path / 'bad.yaml'}: .*contrast names one arm twice"):
        load_plan(tmp_path / "bad.yaml")
    (tmp_path / "few.yaml").write_text((tmp_path / "bad.yaml").read_text().replace("[a, a]", "[a, b]").replace("eval_every: 40", "eval_every: 160"))
    with pytest.raises(ValueError, match="make 2 evaluations a run: fewer than statistic.last 3"):
        load_plan(tmp_path / "few.yaml")
    (tmp_path / "typo.yaml").write_text((tmp_path / "few.yaml").read_text().replace("eval_every: 160", "eval_evry: 40"))
    with pytest.raises(ValueError, match=f"{tmp_path / 'typo.yaml'}: eval_every: Field required"):
        load_plan(tmp_path / "typo.yaml")
    out = write_verdict(results([[0.5] + [0.7 + 0.01 * s] * 7 for s in range(4)], [FLAT] * 4), plan(), tmp_path)
    text = (tmp_path / "verdict.md").read_text()
    assert out["decision"] == "shown" and "Verdict: **shown**." in text and "| lt_opd | 0.715 ± 0.006 |" in text
    assert (tmp_path / "curves.png").stat().st_size > 0
    rows = (tmp_path / "statistic.csv").read_text().splitlines()
    assert rows[0] == "arm,seed,statistic,held_out" and len(rows) == 9 and rows[1].startswith("grpo,0,0.6")


def test_an_evaluation_reports_accuracy_per_kind_of_question():
    from lt_opd_ray.sources.toy.tasks import toy_task

    samples = toy_task("discs").samples(12, "test", seed=3)
    kinds = [s.kind for s in samples]
    assert set(kinds) == {"biggest", "smallest", "top", "left"}
    correct = [i % 3 == 0 for i in range(12)]
    by_kind = Evaluation(500, "cdpruner", [""] * 12, correct).by_kind(samples)
    for kind in set(kinds):
        mine = [c for c, k in zip(correct, kinds) if k == kind]
        assert by_kind[kind] == sum(mine) / len(mine)
    assert Evaluation(500, "cdpruner", [""] * 12, correct).by_kind(toy_task("circles").samples(12)) == {}  # one kind: none reported


def test_equal_pairs_decide_by_their_sign_and_a_difference_of_exactly_zero_shows_nothing():
    assert paired_test([0.6] * 5, [0.6] * 5, 0.05)["t"] == 0.0 and paired_test([0.6] * 5, [0.6] * 5, 0.05)["p"] == 0.5
    assert paired_test([0.61] * 5, [0.6] * 5, 0.05)["p"] == 0.0 and paired_test([0.59] * 5, [0.6] * 5, 0.05)["p"] == 1.0


def test_a_new_study_folder_may_hold_only_the_plan_it_runs(tmp_path):
    from lt_opd_ray.tools.ablation import check_study_folder

    out = tmp_path / "study"
    out.mkdir()
    plan = out / "plan.yaml"
    plan.write_text("job: jobs/toy_discs.yaml\n")
    check_study_folder(out, resume=False, plan_file=plan)  # the plan beside nothing else: a new study starts
    with pytest.raises(ValueError, match="files of its own .plan.yaml first"):
        check_study_folder(out, resume=False)  # without a plan, its file is a file of the folder's own
    (out / "results.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds an earlier study \(--resume continues it\); a new study"):
        check_study_folder(out, resume=False, plan_file=plan)
    check_study_folder(out, resume=True, plan_file=plan)
    (out / "results.json").unlink()
    (out / "link.json").symlink_to(plan)  # a link to the plan is not the plan: a study would write through it
    with pytest.raises(ValueError, match="files of its own .link.json first"):
        check_study_folder(out, resume=False, plan_file=plan)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        check_study_folder(tmp_path / "file", resume=True)
