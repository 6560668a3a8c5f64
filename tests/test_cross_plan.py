"""The selector cross's verdict (`tools/cross_plan.py`) against computations written here: Holm's step-down by its
definition, each verdict a pair can reach from made-up runs, the power at the test's level, the plan's refusals; and
the arms and carried choices it trains with."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from lt_opd_ray.tools.cross_plan import CrossPlan, cross_power, cross_verdict, holm, write_cross_verdict
from lt_opd_ray.tools.plans import read_plan

KINDS = ("biggest", "smallest", "top")
SELECTORS = ("cdpruner", "divprune", "hiprune")
ARMS = {"cdpruner": "lt_opd", "divprune": "lt_opd_divprune", "hiprune": "lt_opd_hiprune"}
TEACHER = {kind: {"full": 0.8, **{s: 0.4 for s in SELECTORS}} for kind in (*KINDS, "left")}  # untrained retain 0.5 everywhere


def plan(**changes) -> CrossPlan:
    data = {"kind": "cross", "job": "jobs/toy_discs.yaml", "out": "runs/x", "trained_with": ARMS, "seeds": 4, "updates": 320,
            "eval_rows": "toy-discs-test:2048", "eval_every": 40, "statistic": {"kinds": list(KINDS), "held_out_kinds": ["left"]},
            "decision": {"alpha": 0.05, "margin": 0.03, "expected_sd": 0.01}}
    return CrossPlan.model_validate(data | changes)


def run(arm: str, seed: int, level: dict[str, float]) -> dict:
    """Eight evaluations, flat after the first: retain `level[selector]` (+ a seed's small wobble) on every trained kind."""
    curve = []
    for e in range(8):
        by_selector = {s: {k: 0.8 * ((0.5 if e == 0 else level[s]) + 0.002 * ((seed * 7 + len(arm)) % 5)) for k in KINDS} | {"left": 0.3}
                       for s in SELECTORS}
        curve.append({"step": 40 * e + 40, "loss": 0.1, "eval": {}, "eval_by_kind": by_selector})
    return {"arm": arm, "seed": seed, "curve": curve}


def results(levels: dict[str, dict[str, float]]) -> dict:
    return {"teacher_by_kind": TEACHER, "runs": [run(arm, seed, levels[arm]) for arm in levels for seed in range(4)]}


def test_holm_rejects_by_its_step_down_definition():
    rng = random.Random(0)
    for _ in range(200):
        p = [rng.choice([0.001, 0.01, 0.02, 0.04, rng.random() / 10]) for _ in range(rng.randint(1, 7))]
        ranked = sorted(range(len(p)), key=lambda i: p[i])
        first_kept = next((r for r, i in enumerate(ranked) if p[i] > 0.05 / (len(p) - r)), len(p))
        assert holm(p, 0.05) == [ranked.index(i) < first_kept for i in range(len(p))]
    assert holm([0.01, 0.04, 0.03], 0.05) == [True, False, False]  # 0.01 <= 0.05/3; 0.03 > 0.05/2 stops it
    assert holm([0.01, 0.02, 0.04], 0.05) == [True, True, True]


def test_each_verdict_a_pair_can_reach():
    """Matched students at 0.70 under their own selector; the CDPruner student keeps 0.69 under DivPrune (within the
    margin: transfers) and 0.60 under HiPrune (a gain over 0.5, but more than the margin below: keeps a gain); the
    HiPrune student is at the untrained 0.5 under CDPruner (no gain)."""
    levels = {"lt_opd": {"cdpruner": 0.70, "divprune": 0.69, "hiprune": 0.60},
              "lt_opd_divprune": {"cdpruner": 0.69, "divprune": 0.70, "hiprune": 0.69},
              "lt_opd_hiprune": {"cdpruner": 0.50, "divprune": 0.69, "hiprune": 0.70}}
    out = cross_verdict(results(levels), plan())
    by_pair = {(p["trained"], p["evaluated"]): p for p in out["pairs"]}
    assert list(by_pair) == [(a, b) for a, b in itertools.product(SELECTORS, SELECTORS) if a != b]
    assert by_pair["cdpruner", "divprune"]["verdict"] == "transfers"
    assert by_pair["cdpruner", "hiprune"]["verdict"] == "keeps a gain"
    assert by_pair["hiprune", "cdpruner"]["verdict"] == "no gain"
    pair = by_pair["cdpruner", "hiprune"]
    assert pair["untrained"] == pytest.approx(0.5) and pair["non_inferiority"]["mean"] == pytest.approx(0.60 - 0.70 + 0.03, abs=0.01)
    climbing = results(levels)
    for r in climbing["runs"]:
        if r["arm"] == "lt_opd_divprune":
            for e, entry in enumerate(r["curve"]):
                entry["eval_by_kind"]["divprune"] = {k: 0.08 * e for k in KINDS}
    out = cross_verdict(climbing, plan())
    assert {(p["trained"], p["evaluated"]) for p in out["pairs"] if p["verdict"] == "no verdict"} == {("cdpruner", "divprune"), ("hiprune", "divprune")}
    short = results(levels)
    short["runs"] = short["runs"][1:]
    assert cross_verdict(short, plan())["why"] == "runs missing: lt_opd seed 0"


def test_the_cross_power_is_the_holm_level_at_no_margin_and_grows_with_the_seeds():
    at_zero = cross_power(plan(decision={"alpha": 0.05, "margin": 1e-9, "expected_sd": 0.01}))
    assert at_zero == pytest.approx(0.05 / 6, abs=0.002)  # six pairs: Holm's first level
    assert cross_power(plan(), seeds=3) < cross_power(plan(), seeds=6) < cross_power(plan(), seeds=12)


def test_the_cross_plan_file_is_refused_by_field_and_its_verdict_written(tmp_path):
    text = ("kind: cross\njob: j\nout: o\ntrained_with: {cdpruner: lt_opd, divprune: lt_opd}\nseeds: 4\nupdates: 320\neval_rows: r\n"
            "eval_every: 40\nstatistic: {kinds: [x]}\ndecision: {margin: 0.03, expected_sd: 0.01}\n")
    (tmp_path / "one-arm.yaml").write_text(text)
    with pytest.raises(ValueError, match=f"{tmp_path / 'one-arm.yaml'}: .*trained_with names one arm for two selectors"):
        read_plan(tmp_path / "one-arm.yaml")
    (tmp_path / "lone.yaml").write_text(text.replace("{cdpruner: lt_opd, divprune: lt_opd}", "{cdpruner: lt_opd}"))
    with pytest.raises(ValueError, match="trained_with: Dictionary should have at least 2 items"):
        read_plan(tmp_path / "lone.yaml")
    (tmp_path / "good.yaml").write_text(text.replace("divprune: lt_opd}", "divprune: lt_opd_divprune}"))
    assert isinstance(read_plan(tmp_path / "good.yaml"), CrossPlan)
    levels = {arm: {s: 0.7 for s in SELECTORS} for arm in ARMS.values()}
    write_cross_verdict(results(levels), plan(), tmp_path)
    verdict = (tmp_path / "verdict.md").read_text()
    assert verdict.count("| transfers |") == 6 and "power" in verdict
    rows = (tmp_path / "statistic.csv").read_text().splitlines()
    assert rows[0] == "arm,seed,evaluated_with,statistic,held_out" and len(rows) == 1 + 3 * 4 * 3


def test_a_study_that_recorded_a_cross_plan_writes_the_crosss_verdict(tmp_path):
    """What a study writes after each run (tools/ablation.save_results) reads the plan it recorded by its kind."""
    from lt_opd_ray.tools.plans import write_plan_verdict

    levels = {arm: {s: 0.7 for s in SELECTORS} for arm in ARMS.values()}
    out = write_plan_verdict(results(levels) | {"plan": plan().model_dump(mode="json")}, tmp_path)
    assert [p["verdict"] for p in out["pairs"]] == ["transfers"] * 6
    assert "non-inferiority to the student trained with B" in (tmp_path / "verdict.md").read_text()


def test_float_rounding_of_equal_retains_is_no_gain():
    from statistics import fmean

    from lt_opd_ray.tools.study_plan import paired_test

    equal = [fmean([0.2] * 3)] * 4  # one ulp above 0.2
    assert paired_test(equal, [0.2] * 4, 0.05)["p"] == 0.5


def test_the_cross_arms_train_with_their_selector_at_lt_opds_carried_choices(tmp_path):
    from lt_opd_ray.config.loading import load_job
    from lt_opd_ray.tools.ablation import arm_job
    from lt_opd_ray.tools.ablation_choices import carried_choices

    from lt_opd_ray.tools.ablation import ARMS as ALL_ARMS
    from lt_opd_ray.tools.ablation_report import LABELS

    assert set(ALL_ARMS) <= set(LABELS)  # every arm a study can train has its table's name
    job = load_job("jobs/toy_discs.yaml")
    assert [arm_job(job, arm, 0, tmp_path).selector.name for arm in ARMS.values()] == list(SELECTORS)
    earlier = {"base_job": "jobs/toy_discs.yaml", "budget_bps": job.eval_budget_bps, "selectors": ["cdpruner", "divprune"],
               "trained_with": "cdpruner", "steps": 320, "lr_scales": [0.3, 1.0, 3.0], "chosen_lr_scale": {"lt_opd": 3.0, "grpo": 1.0}}
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    carried = carried_choices(str(tmp_path / "results.json"), "jobs/toy_discs.yaml", job, list(ARMS.values()))
    assert carried["lr_scale"] == {"lt_opd": 3.0, "lt_opd_divprune": 3.0, "lt_opd_hiprune": 3.0}
    (tmp_path / "other.json").write_text(json.dumps({**earlier, "trained_with": "divprune"}))
    with pytest.raises(ValueError, match=r"a study of another task \(trained_with 'divprune' \(here 'cdpruner'\)\)"):
        carried_choices(str(tmp_path / "other.json"), "jobs/toy_discs.yaml", job, ["lt_opd"])


def test_a_cross_plan_whose_arms_train_with_other_selectors_is_refused_before_anything_runs(tmp_path):
    from lt_opd_ray.tools.ablation import run_plan

    text = ("kind: cross\njob: jobs/toy_discs.yaml\nout: OUT\ntrained_with: {divprune: lt_opd_hiprune, hiprune: lt_opd_divprune}\n"
            "seeds: 4\nupdates: 320\neval_rows: toy-discs-test:2048\neval_every: 40\nstatistic: {kinds: [biggest]}\n"
            "decision: {margin: 0.03, expected_sd: 0.01}\n").replace("OUT", str(tmp_path / "study"))
    (tmp_path / "swapped.yaml").write_text(text)
    with pytest.raises(ValueError, match="trained_with: lt_opd_hiprune trains with hiprune, not divprune; lt_opd_divprune trains with divprune, not hiprune"):
        run_plan(str(tmp_path / "swapped.yaml"))
    (tmp_path / "unknown.yaml").write_text(text.replace("divprune: lt_opd_hiprune", "dpp: lt_opd_hiprune"))
    with pytest.raises(ValueError, match="trained_with: unknown selector.s. dpp; known: cdpruner, divprune, fastv"):
        run_plan(str(tmp_path / "unknown.yaml"))
    assert not (tmp_path / "study").exists()
