"""A pre-registered selector cross, read from a plan file (`kind: cross`): LT-OPD trained with each of several
selectors, every student evaluated with every one of them; does a student trained with selector A keep its gain
when served with selector B?

For each ordered pair (A, B), A != B, over the plan's paired seeds, with the primary statistic of the core-claim
study (tools/study_plan.py: the mean of a run's last evaluations' retain over the trained kinds, one definition), read
with B:
- gain: the A-trained student's statistic under B is above the untrained student's under B (the teacher at the
  budget with B on the same rows: one number, so a one-sample t-test over the seeds);
- non-inferiority: it is above the B-trained student's statistic under B less `decision.margin` (a paired t-test of
  A-trained - B-trained + margin > 0, seed s of both arms trained on one data order).
Each family of tests (the gains; the non-inferiorities) is corrected over the pairs by Holm's step-down at
`decision.alpha`. A pair `transfers` where both hold, `keeps a gain` where only the gain does, and shows `no gain`
otherwise; `no verdict` where a run is missing or a curve the pair reads is not flat by the plan's rule. The power
the plan states is the non-inferiority test's at no true difference, with the per-seed SD it expects and Holm's first
(strictest) level, alpha / pairs.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from lt_opd_ray.config.base import StrictModel
from lt_opd_ray.tools.study_plan import PairedStudy, SAMPLER_SEED, critical_t, evaluations, flatness, kind_retain, paired_test, run_statistic


class CrossDecision(StrictModel):
    alpha: float = Field(0.05, gt=0.0, lt=0.5)
    """Each family's level (the gains; the non-inferiorities), Holm-corrected over the pairs."""
    margin: float = Field(gt=0.0, lt=1.0)
    """How far below the student trained with B a student trained with A may be under B and still keep its gain."""
    expected_sd: float = Field(gt=0.0, lt=1.0)
    """The SD of a per-seed difference between two arms the plan expects (from a pilot or an earlier study)."""


class CrossPlan(PairedStudy):
    kind: Literal["cross"]
    trained_with: dict[str, str] = Field(min_length=2)
    """Each selector the cross trains with and the arm that trains with it (tools/ablation.py ARMS); every student is
    evaluated with each of these selectors."""
    decision: CrossDecision

    @property
    def selectors(self) -> list[str]:
        return list(self.trained_with)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """(trained with A, evaluated with B), A != B, in the plan's order."""
        return [(a, b) for a in self.selectors for b in self.selectors if a != b]

    @model_validator(mode="after")
    def _selectors_and_arms(self) -> CrossPlan:
        from lt_opd_ray.core.selectors import SELECTORS

        if unknown := [name for name in self.trained_with if name not in SELECTORS]:
            raise ValueError(f"trained_with: unknown selector(s) {', '.join(unknown)}; known: {', '.join(sorted(SELECTORS))}")
        if len(set(self.trained_with.values())) != len(self.trained_with):
            raise ValueError("trained_with names one arm for two selectors")
        return self


def holm(p_values: list[float], alpha: float) -> list[bool]:
    """Holm's step-down: sorted ascending, the i-th smallest (from 0) is rejected while p <= alpha / (m - i)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for rank, index in enumerate(order):
        if p_values[index] > alpha / (len(p_values) - rank):
            break
        rejected[index] = True
    return rejected


def cross_power(plan: CrossPlan, seeds: int | None = None, draws: int = 200_000) -> float:
    """P(non-inferiority shown) for a pair with no true difference, per-seed SD decision.expected_sd, `seeds` pairs
    (the plan's by default), at Holm's first level alpha / pairs."""
    n, d = seeds or plan.seeds, plan.decision
    generator = torch.Generator().manual_seed(SAMPLER_SEED)
    diffs = d.margin + d.expected_sd * torch.randn(draws, n, generator=generator, dtype=torch.float64)
    t = diffs.mean(1) / (diffs.std(1) / math.sqrt(n))
    return float((t > critical_t(n - 1, d.alpha / len(plan.pairs))).double().mean())


def cross_verdict(results: dict, plan: CrossPlan) -> dict:
    """Every pair's statistics, its two tests, their Holm decisions and the pair's verdict (see the module)."""
    teacher, s, d, seeds = results["teacher_by_kind"], plan.statistic, plan.decision, plan.seed_list
    runs = {(r["arm"], r["seed"]): r for r in results["runs"]}
    missing = [f"{arm} seed {seed}" for arm in plan.trained_with.values() for seed in seeds if (arm, seed) not in runs]
    out = {"pairs": [], "seeds": seeds, "missing": missing, "power": cross_power(plan)}
    if missing:
        return {**out, "why": f"runs missing: {', '.join(missing)}"}

    def series(selector: str, evaluated: str) -> list[float]:
        return [run_statistic(runs[plan.trained_with[selector], seed], teacher, s.kinds, evaluated, s.last) for seed in seeds]

    for a, b in plan.pairs:
        crossed, matched = series(a, b), series(b, b)
        untrained = kind_retain({kind: teacher[kind][b] for kind in s.kinds}, teacher, s.kinds)
        flat = all(flatness([runs[plan.trained_with[x], seed] for seed in seeds], teacher, s.kinds, b, plan.flat_window)["flat"] for x in (a, b))
        out["pairs"].append({"trained": a, "evaluated": b, "crossed": crossed, "matched": matched, "untrained": untrained, "flat": flat,
                             "gain": paired_test(crossed, [untrained] * len(seeds), d.alpha),
                             "non_inferiority": paired_test(crossed, [m - d.margin for m in matched], d.alpha)})
    for family in ("gain", "non_inferiority"):
        for pair, shown in zip(out["pairs"], holm([p[family]["p"] for p in out["pairs"]], d.alpha)):
            pair[family]["shown"] = shown
    for pair in out["pairs"]:
        pair["verdict"] = ("no verdict" if not pair["flat"] else "transfers" if pair["gain"]["shown"] and pair["non_inferiority"]["shown"]
                           else "keeps a gain" if pair["gain"]["shown"] else "no gain")
    return {**out, "why": ""}


def cross_lines(result: dict, plan: CrossPlan) -> list[str]:
    """The verdict in words and one table row a pair, every number the rule reads."""
    s, d = plan.statistic, plan.decision
    lines = [f"Plan: LT-OPD trained with {', '.join(f'{sel} ({arm})' for sel, arm in plan.trained_with.items())}; each student"
             f" evaluated with each; statistic: the mean of the last {s.last} evaluations' retain over the kinds {', '.join(s.kinds)}"
             f" ({plan.eval_rows}), seeds {plan.first_seed}-{plan.seed_list[-1]} paired; per pair (trained with A, evaluated with B):"
             f" gain over the untrained student (one-sample t) and non-inferiority to the student trained with B at margin {d.margin:g}"
             f" (paired t), each family Holm-corrected over {len(plan.pairs)} pairs at {d.alpha:g}; power {result['power']:.2f} for"
             f" non-inferiority at no true difference with a per-seed SD of {d.expected_sd:g}.", ""]
    if result["missing"]:
        return lines + [f"No verdict: {result['why']}."]
    lines += ["| trained with | evaluated with | crossed, mean ± SE | matched | untrained | gain (p) | crossed - matched ± SE (p, margin) | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for p in result["pairs"]:
        crossed, gain, ni = p["crossed"], p["gain"], p["non_inferiority"]
        se = statistics.stdev(crossed) / math.sqrt(len(crossed))
        lines.append(f"| {p['trained']} | {p['evaluated']} | {statistics.fmean(crossed):.3f} ± {se:.3f} | {statistics.fmean(p['matched']):.3f} |"
                     f" {p['untrained']:.3f} | {gain['mean']:+.3f} ({gain['p']:.4f}{', shown' if gain['shown'] else ''}) |"
                     f" {ni['mean'] - d.margin:+.4f} ± {ni['se']:.4f} ({ni['p']:.4f}{', shown' if ni['shown'] else ''}) | {p['verdict']} |")
    return lines


def write_cross_verdict(results: dict, plan: CrossPlan, out_dir: Path) -> dict:
    """verdict.md and statistic.csv (every finished run's statistic and held-out retain under every selector)."""
    import csv

    result = cross_verdict(results, plan)
    (out_dir / "verdict.md").write_text("\n".join(cross_lines(result, plan)) + "\n")
    s, teacher = plan.statistic, results["teacher_by_kind"]
    with open(out_dir / "statistic.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "evaluated_with", "statistic", "held_out"])
        for run in sorted(results["runs"], key=lambda r: (r["arm"], r["seed"])):
            for selector in plan.selectors:
                if len(evaluations(run, selector)) >= s.last:
                    held = run_statistic(run, teacher, s.held_out_kinds, selector, s.last) if s.held_out_kinds else ""
                    writer.writerow([run["arm"], run["seed"], selector, run_statistic(run, teacher, s.kinds, selector, s.last), held])
    return result
