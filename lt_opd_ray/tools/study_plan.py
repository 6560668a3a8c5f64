"""A pre-registered contrast of two arms, read from a plan file: what runs, the primary statistic, the verdict's rule.

The plan (YAML, `StudyPlan`) is committed before the study's first run. `lt-opd ablation --plan PLAN` runs the study
it names: paired seeds (seed s of each arm trains on the same data order, and every run is evaluated on the same
rows), each arm at the settings an earlier study chose on validation rows (`choices_from`). The verdict is computed
from the plan alone (`verdict`): no threshold is left to prose.

Retain has one definition end to end (`kind_retain`): on each kind of question, the accuracy at the budget with the
plan's selector / the teacher's full-token accuracy on that kind, averaged over the plan's kinds with equal weight.
The primary statistic of a run is its mean over the run's last `statistic.last` evaluations, on the trained kinds;
the held-out kinds are reported beside it, never in it. The test is a paired t-test over the seeds, one-sided for
the claim `contrast[0] > contrast[1]`: its p-value and critical value from torch's Student-t density, integrated; the
power the plan expects from paired differences drawn at the plan's effect and SD (seeded: the same plan, the same
number).
"""

from __future__ import annotations

import functools
import math
import statistics
from pathlib import Path

from pydantic import Field, ValidationError, model_validator

from lt_opd_ray.config.base import StrictModel

SAMPLER_SEED = 0
ROUNDING = 1e-12  # differences and spreads below this are float rounding of equal retains, not data


class KindsStatistic(StrictModel):
    kinds: list[str] = Field(min_length=1)
    """The kinds of question the statistic averages (the trained kinds)."""
    held_out_kinds: list[str] = []
    """Kinds reported beside the statistic, never in it (asked only in evaluation)."""
    last: int = Field(3, ge=1, le=20)
    """How many of a run's last evaluations the statistic averages."""


class StatisticPlan(KindsStatistic):
    selector: str = "cdpruner"
    """The eval selector the statistic reads (one of the job's eval.selectors)."""


class DecisionPlan(StrictModel):
    alpha: float = Field(0.05, gt=0.0, lt=0.5)
    """The one-sided test's level for the claim contrast[0] > contrast[1]."""
    minimal_effect: float = Field(gt=0.0, lt=1.0)
    """The smallest difference in retain the study is to decide (its power is stated at it)."""
    expected_sd: float = Field(gt=0.0, lt=1.0)
    """The standard deviation of the per-seed difference the plan expects (a pilot's, or an earlier study's)."""


class PairedStudy(StrictModel):
    """What every pre-registered plan names: the runs (paired seeds, their length and evaluations) and the flatness
    rule; a plan adds its arms, statistic and decision."""

    job: str
    """The base job (a toy task's, with eval.data's kinds)."""
    out: str
    """The study's folder: results.json, verdict.md, statistic.csv."""
    seeds: int = Field(ge=2, le=64)
    """How many paired seeds every arm trains: first_seed, first_seed + 1, ..."""
    first_seed: int = Field(0, ge=0)
    """The first of them (a pilot takes seeds apart from the study's)."""
    updates: int = Field(ge=1)
    """Updates per run (the job's curriculum rescaled)."""
    choices_from: str | None = None
    """An earlier study's results.json whose choices on validation rows (learning rates, RL settings) every arm takes."""
    eval_rows: str
    """The held-out rows every run is evaluated on (replaces the job's eval.data)."""
    eval_every: int = Field(ge=1)
    """Updates between a run's evaluations (replaces the job's eval.every_steps)."""
    statistic: KindsStatistic
    flat_window: int = Field(2, ge=1)
    """A curve is flat when, per seed, the mean statistic of its last `flat_window` evaluations minus the mean of the
    `flat_window` before them averages within 2 SE of zero over the seeds; no verdict is drawn from a curve that is not."""

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    @model_validator(mode="after")
    def _runs_read_enough(self) -> PairedStudy:
        if overlap := set(self.statistic.kinds) & set(self.statistic.held_out_kinds):
            raise ValueError(f"statistic: kinds {sorted(overlap)} are both in the statistic and held out")
        made = self.updates // self.eval_every
        if made < max(self.statistic.last, 2 * self.flat_window):
            raise ValueError(f"{self.updates} updates evaluated every {self.eval_every} make {made} evaluations a run: fewer than"
                             f" statistic.last {self.statistic.last} or the {2 * self.flat_window} that flatness reads")
        return self


class StudyPlan(PairedStudy):
    contrast: tuple[str, str]
    """(a, b): the claim tested is that arm a's statistic is above arm b's."""
    statistic: StatisticPlan
    decision: DecisionPlan

    @model_validator(mode="after")
    def _two_arms(self) -> StudyPlan:
        if self.contrast[0] == self.contrast[1]:
            raise ValueError(f"contrast names one arm twice ({self.contrast[0]})")
        return self


def load_plan(path: str | Path, kinds: dict | None = None):
    """The plan in `path`: a contrast (`StudyPlan`), or the model `kinds` maps its `kind` field to (the selector cross:
    tools/plans.py); a ValueError naming the file and the field otherwise."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
        kind = data.get("kind") if isinstance(data, dict) else None
        return (kinds or {}).get(kind, StudyPlan).model_validate(data)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(the file)"
        raise ValueError(f"{path}: {where}: {first['msg']}") from None


# ---------------------------------------------------------------- the statistic
def kind_retain(accuracy_by_kind: dict[str, float], teacher_by_kind: dict[str, dict[str, float]], kinds: list[str]) -> float:
    """Retain over `kinds`: each kind's accuracy / the teacher's full-token accuracy on it, averaged with equal weight."""
    missing = [kind for kind in kinds if kind not in accuracy_by_kind]
    if missing:
        raise ValueError(f"no accuracy on kind(s) {', '.join(missing)} (the evaluation has {', '.join(accuracy_by_kind) or 'none'})")
    return sum(accuracy_by_kind[kind] / teacher_by_kind[kind]["full"] for kind in kinds) / len(kinds)


def evaluations(run: dict, selector: str) -> list[dict[str, float]]:
    """The run's evaluations in order: accuracy by kind with `selector`, at each evaluated update."""
    return [entry["eval_by_kind"][selector] for entry in run["curve"] if entry.get("eval_by_kind", {}).get(selector)]


def run_statistic(run: dict, teacher_by_kind: dict, kinds: list[str], selector: str, last: int) -> float:
    """The mean of `kind_retain` over the run's last `last` evaluations."""
    made = evaluations(run, selector)
    if len(made) < last:
        raise ValueError(f"{run['arm']} seed {run['seed']}: {len(made)} evaluations by kind, the statistic averages the last {last}")
    return statistics.fmean(kind_retain(e, teacher_by_kind, kinds) for e in made[-last:])


# ---------------------------------------------------------------- the test
def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom: torch's t density integrated from 0 to |t| (trapezoids
    on 20,001 points: exact to ~1e-8 at the t a test reads)."""
    import torch

    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    x = torch.linspace(0.0, abs(t), 20_001, dtype=torch.float64)
    area = float(torch.trapezoid(torch.distributions.StudentT(torch.tensor(float(df), dtype=torch.float64)).log_prob(x).exp(), x))
    return 0.5 + math.copysign(area, t)


@functools.lru_cache(maxsize=256)
def critical_t(df: int, alpha: float) -> float:
    """The one-sided critical value: P(T > t) = alpha under the null (bisection on `t_cdf`; each (df, alpha) once)."""
    low, high = 0.0, 1000.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if 1 - t_cdf(middle, df) > alpha else (low, middle)
    return (low + high) / 2


def power(plan: StudyPlan, draws: int = 400_000) -> float:
    """P(the test shows a > b) when the true difference is decision.minimal_effect and the per-seed difference's
    SD is decision.expected_sd: Student's t of `seeds` paired differences drawn as such."""
    import torch

    n, d = plan.seeds, plan.decision
    generator = torch.Generator().manual_seed(SAMPLER_SEED)
    diffs = d.minimal_effect + d.expected_sd * torch.randn(draws, n, generator=generator, dtype=torch.float64)
    t = diffs.mean(1) / (diffs.std(1) / math.sqrt(n))
    return float((t > critical_t(n - 1, d.alpha)).double().mean())


def paired_test(a: list[float], b: list[float], alpha: float) -> dict:
    """The paired t-test of a > b: the mean difference, its SD and SE over the pairs, t, the one-sided p-value, the
    critical value and the two-sided (1 - 2 alpha) interval."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    mean, sd = (0.0 if abs(mean) < ROUNDING else mean), (0.0 if sd < ROUNDING else sd)  # a mean of three equal retains may be 1 ulp off
    se = sd / math.sqrt(n)
    t = mean / se if se > 0 else math.copysign(math.inf, mean) if mean else 0.0  # equal pairs: no difference is no evidence
    crit = critical_t(n - 1, alpha)
    return {"n": n, "diffs": diffs, "mean": mean, "sd": sd, "se": se, "t": t, "df": n - 1, "p": 1 - t_cdf(t, n - 1),
            "critical_t": crit, "interval": (mean - crit * se, mean + crit * se)}


def flatness(runs: list[dict], teacher_by_kind: dict, kinds: list[str], selector: str, window: int) -> dict:
    """Per seed, the mean statistic (per evaluation, `kind_retain` on `kinds` with `selector`) of the last `window`
    evaluations minus the `window` before; its mean over the seeds, SE and whether it is within 2 SE of zero."""
    moves = []
    for run in runs:
        made = [kind_retain(e, teacher_by_kind, kinds) for e in evaluations(run, selector)]
        if len(made) < 2 * window:
            raise ValueError(f"{run['arm']} seed {run['seed']}: {len(made)} evaluations, flatness reads {2 * window}")
        moves.append(statistics.fmean(made[-window:]) - statistics.fmean(made[-2 * window : -window]))
    mean = statistics.fmean(moves)
    se = statistics.stdev(moves) / math.sqrt(len(moves)) if len(moves) > 1 else math.inf
    return {"moves": moves, "mean": mean, "se": se, "flat": abs(mean) <= 2 * se}


def verdict(results: dict, plan: StudyPlan) -> dict:
    """The plan's verdict on a study's results: every arm's statistic per seed, the paired test, flatness, and the
    decision: `shown` (t above the critical value), `reversed` (below its negative), `not shown`; `no verdict` where
    a curve is not flat or a seed is missing. `ruled_out`: the interval lies below decision.minimal_effect."""
    a, b = plan.contrast
    teacher, s = results["teacher_by_kind"], plan.statistic
    by_arm = {arm: {r["seed"]: r for r in results["runs"] if r["arm"] == arm} for arm in (a, b)}
    seeds = plan.seed_list
    missing = [f"{arm} seed {seed}" for arm in (a, b) for seed in seeds if seed not in by_arm[arm]]
    out = {"contrast": [a, b], "seeds": seeds, "missing": missing, "power": power(plan)}
    if missing:
        return {**out, "decision": "no verdict", "why": f"runs missing: {', '.join(missing)}"}
    for arm in (a, b):
        runs = [by_arm[arm][seed] for seed in seeds]
        out[arm] = {
            "statistic": [run_statistic(r, teacher, s.kinds, s.selector, s.last) for r in runs],
            "held_out": [run_statistic(r, teacher, s.held_out_kinds, s.selector, s.last) for r in runs] if s.held_out_kinds else None,
            "flatness": flatness(runs, teacher, s.kinds, s.selector, plan.flat_window),
        }
    test = paired_test(out[a]["statistic"], out[b]["statistic"], plan.decision.alpha)
    out["test"] = test
    out["ruled_out"] = test["interval"][1] < plan.decision.minimal_effect
    if not_flat := [arm for arm in (a, b) if not out[arm]["flatness"]["flat"]]:
        return {**out, "decision": "no verdict", "why": f"not flat by the plan's rule: {', '.join(not_flat)}"}
    decision = "shown" if test["t"] > test["critical_t"] else "reversed" if test["t"] < -test["critical_t"] else "not shown"
    return {**out, "decision": decision, "why": ""}


def verdict_lines(result: dict, plan: StudyPlan) -> list[str]:
    """The verdict in words, every number the plan's rule reads."""
    a, b = plan.contrast
    d, s = plan.decision, plan.statistic
    lines = [f"Plan: {a} > {b} on the mean of the last {s.last} evaluations' retain over the kinds {', '.join(s.kinds)} with {s.selector}"
             f" ({plan.eval_rows}), paired over seeds {plan.first_seed}-{plan.seed_list[-1]}; one-sided paired t-test at {d.alpha:g}; power"
             f" {result['power']:.2f} at a difference of {d.minimal_effect:g} with a per-seed SD of {d.expected_sd:g}.", ""]
    if result["missing"]:
        return lines + [f"No verdict: {result['why']}."]
    test = result["test"]
    lines += ["| arm | statistic, mean ± SE | per seed | held-out kinds | flatness (last - before, mean ± SE) |", "|---|---|---|---|---|"]
    for arm in (a, b):
        r = result[arm]
        values, flat = r["statistic"], r["flatness"]
        held = f"{statistics.fmean(r['held_out']):.3f}" if r["held_out"] else "-"
        lines.append(f"| {arm} | {statistics.fmean(values):.3f} ± {statistics.stdev(values) / math.sqrt(len(values)):.3f} |"
                     f" {' / '.join(f'{v:.3f}' for v in values)} | {held} |"
                     f" {flat['mean']:+.3f} ± {flat['se']:.3f} ({'flat' if flat['flat'] else 'not flat'}) |")
    low, high = test["interval"]
    lines += ["", f"Difference {a} - {b}: {test['mean']:+.4f} ± {test['se']:.4f} (SE over {test['n']} pairs; SD {test['sd']:.4f}),"
                  f" t = {test['t']:.2f} on {test['df']} df, one-sided p = {test['p']:.4f} (critical t {test['critical_t']:.3f});"
                  f" {100 * (1 - 2 * d.alpha):g}% interval [{low:+.4f}, {high:+.4f}].",
              f"Verdict: **{result['decision']}**" + (f" ({result['why']})" if result["why"] else "")
              + (f"; a difference of {d.minimal_effect:g} or more is ruled out." if result["ruled_out"] else ".")]
    return lines


def write_verdict(results: dict, plan: StudyPlan, out_dir: Path) -> dict:
    """A plan study's report, every figure in the plan's one definition of retain: verdict.md, statistic.csv (every
    finished run's primary statistic and held-out retain) and curves.png (each evaluation's retain over the plan's
    kinds); the verdict."""
    import csv

    from lt_opd_ray.tools.ablation_report import plot_curves

    result = verdict(results, plan)
    (out_dir / "verdict.md").write_text("\n".join(verdict_lines(result, plan)) + "\n")
    s = plan.statistic
    with open(out_dir / "statistic.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "statistic", "held_out"])
        for run in sorted(results["runs"], key=lambda r: (r["arm"], r["seed"])):
            if len(evaluations(run, s.selector)) >= s.last:
                held = run_statistic(run, results["teacher_by_kind"], s.held_out_kinds, s.selector, s.last) if s.held_out_kinds else ""
                writer.writerow([run["arm"], run["seed"], run_statistic(run, results["teacher_by_kind"], s.kinds, s.selector, s.last), held])
    teacher, selector = results["teacher_by_kind"], plan.statistic.selector
    plot_curves(results, out_dir / "curves.png",
                retain=lambda entry: kind_retain(entry["eval_by_kind"][selector], teacher, s.kinds) if selector in entry.get("eval_by_kind", {}) else None,
                untrained=kind_retain({kind: teacher[kind][selector] for kind in s.kinds}, teacher, s.kinds),
                measure=f"retain over {', '.join(s.kinds)} ({selector})")
    return result

