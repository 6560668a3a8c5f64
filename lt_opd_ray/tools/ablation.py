"""The paper's ablations on a toy task (lt_opd_ray/toy), each trained through the real distributed system.

Arms (all at the job's target budget, same teacher, same data):
  untrained       the teacher itself with the selector, no training
  sft             the paper's SFT: cross-entropy on the rows' own responses (one per row, so sampling.n 1)
  fixed_prefix    the paper's fixed-prefix JSD: the teacher's distributions on the rows' own responses, with the
                  curriculum (sampling.n 1)
  sequence_kd     cross-entropy on responses the full-token teacher sampled (sequence-level distillation)
  teacher_prefix  the teacher's distributions on responses it sampled, with the curriculum
  lt_opd_no_curriculum   LT-OPD at the target budget from the first update
  lt_opd          LT-OPD (docs/architecture.md §1)
  lt_opd_reverse_kl      LT-OPD with reverse KL instead of JSD
  lt_opd_token_merge     LT-OPD with the release's learnable token merge (not in the paper's table: asked for by name)
Every trained arm is evaluated with each of the job's eval selectors, so the
table also shows a student trained with one selector and evaluated with another.
Retain = accuracy at the budget / the teacher's full-token accuracy, on the same
held-out items; mean ± standard error over seeds.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from pathlib import Path

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.curriculum import BPS

ARMS: dict[str, dict] = {
    "sft": {"objective": {"mode": "sft"}, "sampling": {"n": 1}},
    "fixed_prefix": {"objective": {"mode": "fixed_prefix"}, "sampling": {"n": 1}},
    "sequence_kd": {"objective": {"mode": "sequence_kd"}},
    "teacher_prefix": {"objective": {"mode": "teacher_prefix"}},
    "lt_opd_no_curriculum": {"budget": {"warm_steps": 0, "decay_end": 0}},  # start_bps set to target below
    "lt_opd": {},
    "lt_opd_reverse_kl": {"objective": {"divergence": "reverse_kl"}},
    "lt_opd_token_merge": {"selector": {"merge": "learnable"}},  # the paper's release: CDPruner + learnable token merge
}
STUDY_ARMS = ("sft", "fixed_prefix", "lt_opd_no_curriculum", "lt_opd", "lt_opd_reverse_kl")  # the paper's ablation table
LABELS = {
    "untrained": "untrained",
    "sft": "SFT on the data's responses",
    "fixed_prefix": "fixed-prefix JSD on the data's responses",
    "sequence_kd": "SFT on teacher samples (sequence KD)",
    "teacher_prefix": "distillation on teacher samples",
    "lt_opd_no_curriculum": "LT-OPD, no curriculum",
    "lt_opd": "LT-OPD",
    "lt_opd_reverse_kl": "LT-OPD, reverse KL",
    "lt_opd_token_merge": "LT-OPD + learnable token merge",
}


def _merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        merged[key] = _merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def arm_job(base: JobConfig, arm: str, seed: int, out: Path, steps: int | None = None) -> JobConfig:
    """The base job specialised to one arm and seed; `steps` rescales the curriculum to a shorter run."""
    data = base.model_dump()
    if steps is not None:
        scale = steps / base.budget.total_steps
        data["budget"].update(
            total_steps=steps,
            warm_steps=round(base.budget.warm_steps * scale),
            decay_end=round(base.budget.decay_end * scale),
        )
        data["eval"]["every_steps"] = max(1, round(base.eval.every_steps * scale))
    data = _merge(data, ARMS[arm])
    if arm == "lt_opd_no_curriculum":
        data["budget"]["start_bps"] = data["budget"]["target_bps"]
    data.update(name=f"{base.name}-{arm}-s{seed}", seed=seed)
    data["data"]["shuffle_seed"] = seed
    data["checkpoint"]["dir"] = str(out / arm / f"seed{seed}")
    return JobConfig.model_validate(data)


def evaluate_untrained(job: JobConfig) -> tuple[dict[str, float], int]:
    """The teacher's accuracy at full tokens and, per eval selector, at the eval budget (single process); the item count."""
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.evaluation import evaluate_answers
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import VLMProcessor
    from lt_opd_ray.sources.resolve import load_samples, resolve_model_dir

    model_dir, model = load_vlm(resolve_model_dir(job.model.path), "cpu", token_merge=job.selector.merge == "learnable")
    vlm, processor = QwenVLM(model.eval()), VLMProcessor(model_dir)
    samples = load_samples(job.eval.data, job.data.image_root, job.seed)
    budget = job.eval_budget_bps
    kwargs = dict(k_min=job.budget.k_min, system_prompt=job.data.system_prompt, max_new_tokens=job.eval.max_new_tokens)
    result = {"full": evaluate_answers(vlm, processor, samples, BPS, **kwargs).accuracy}
    for selector in job.eval.selectors:
        result[selector] = evaluate_answers(vlm, processor, samples, budget, selector, **kwargs).accuracy
    return result, len(samples)


def run_ablation(base_path: str, out: str, seeds: list[int], steps: int | None = None, arms: list[str] | None = None) -> dict:
    """Train every arm for every seed through the distributed runtime; write results, table and curves to `out`."""
    import ray

    from lt_opd_ray.runtime.launch import claim_run_folder, init_ray, run

    base = load_job(base_path)
    if not base.eval.data:
        raise ValueError(f"{base_path}: the ablation needs eval.data (held-out rows with answers)")
    arms = arms or list(STUDY_ARMS)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    teacher, eval_items = evaluate_untrained(base)  # also trains the toy teacher on first use
    print(f"teacher: full-token accuracy {teacher['full']:.3f}; at the budget: "
          + ", ".join(f"{s} {teacher[s]:.3f}" for s in base.eval.selectors), flush=True)
    runs: list[dict] = []
    results = {"base_job": base_path, "seeds": seeds, "steps": steps or base.budget.total_steps,
               "budget_bps": base.eval_budget_bps, "selectors": list(base.eval.selectors),
               "trained_with": base.selector.name,
               "teacher": teacher, "eval_items": eval_items, "runs": runs, "seconds": 0.0, "complete": False}
    init_ray(base)
    try:
        for seed in seeds:
            for arm in arms:
                job = arm_job(base, arm, seed, out_dir, steps)
                claim_run_folder(Path(job.checkpoint.dir), resume=False, force=True)  # a study run again starts each arm afresh
                started = time.perf_counter()
                logs = run(job)
                final = logs[-1].eval_accuracy
                runs.append({
                    "arm": arm, "seed": seed, "seconds": time.perf_counter() - started, "final": final,
                    "curve": [{"step": log.step + 1, "budget_bps": log.budget_bps, "loss": log.loss,
                               "divergence": log.divergence, "eval": log.eval_accuracy} for log in logs],
                })
                print(f"{arm} seed {seed}: " + ", ".join(f"{s} {a:.3f}" for s, a in final.items())
                      + f"  ({runs[-1]['seconds']:.0f}s)", flush=True)
                save_results(results, out_dir, begin)  # a study cut short keeps every finished run
    finally:
        ray.shutdown()
    results["complete"] = True
    save_results(results, out_dir, begin)
    return results


# the paper's ordering at 5% (68.6 < 70.4 < 77.6 < 81.5 <= 82.3)
PAPER_ORDER = ("untrained", "sft", "fixed_prefix", "lt_opd_no_curriculum", "lt_opd")


def save_results(results: dict, out_dir: Path, begin: float) -> None:
    """results.json (replaced atomically), the tables and the curves, for the runs finished so far."""
    results["seconds"] = time.perf_counter() - begin
    staging = out_dir / "results.json.tmp"
    staging.write_text(json.dumps(results, indent=1))
    staging.replace(out_dir / "results.json")
    write_report(results, out_dir)


def retain_rows(results: dict) -> list[dict]:
    """One row per (arm, eval selector): retain's mean, std and standard error.

    A trained arm's standard error is over seeds (std / sqrt(seeds)); the untrained
    student has one evaluation, so its standard error is the binomial one over the
    held-out items (when the results record how many).
    """
    full, items = results["teacher"]["full"], results.get("eval_items")
    rows = []
    for selector in results["selectors"]:
        accuracy = results["teacher"][selector]
        binomial = math.sqrt(accuracy * (1 - accuracy) / items) / full if items else 0.0
        rows.append({"arm": "untrained", "trained_with": "-", "evaluated_with": selector,
                     "retain_mean": accuracy / full, "retain_std": 0.0, "retain_se": binomial, "seeds": 0})
    arms = list(dict.fromkeys(r["arm"] for r in results["runs"]))
    for arm in arms:
        for selector in results["selectors"]:
            values = [r["final"][selector] / full for r in results["runs"] if r["arm"] == arm]
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            rows.append({"arm": arm, "trained_with": results["trained_with"], "evaluated_with": selector,
                         "retain_mean": statistics.fmean(values), "retain_std": std,
                         "retain_se": std / math.sqrt(len(values)), "seeds": len(values)})
    return rows


def ordering_lines(rows: list[dict], selector: str) -> list[str]:
    """Each step of the paper's ordering on `selector`: the difference of means, its standard error, and whether it holds."""
    by_arm = {r["arm"]: r for r in rows if r["evaluated_with"] == selector}
    present = [arm for arm in PAPER_ORDER if arm in by_arm]
    lines = []
    for lower, upper in zip(present, present[1:]):
        a, b = by_arm[lower], by_arm[upper]
        difference, se = b["retain_mean"] - a["retain_mean"], math.hypot(a["retain_se"], b["retain_se"])
        strict = (lower, upper) != ("lt_opd_no_curriculum", "lt_opd")  # the paper's last step is "<=" (81.5 vs 82.3)
        verdict = "holds" if (difference > 2 * se if strict else difference > -2 * se) else "does not hold"
        relation = "<" if strict else "<="
        lines.append(f"- {LABELS[lower]} {relation} {LABELS[upper]}: difference {difference:+.3f} ± {se:.3f} (SE): {verdict}")
    return lines


def write_report(results: dict, out_dir: Path) -> None:
    """retain_table.md / .csv and curves.png."""
    rows = retain_rows(results)
    budget = results["budget_bps"] / 100
    items = results.get("eval_items")
    lines = [
        f"Toy task ({results['base_job']}), budget {budget:g}% of the visual tokens, teacher full-token accuracy"
        f" {results['teacher']['full']:.3f}; retain = accuracy / full-token accuracy"
        + (f" on {items} held-out items" if items else "")
        + f", mean ± standard error over {len(results['seeds'])} seed(s) (std in brackets), {results['steps']} updates per run,"
        f" wall time {results['seconds'] / 60:.1f} min." + ("" if results.get("complete", True) else " PARTIAL: the study was cut short."),
        "",
        "| arm | evaluated with | retain |",
        "|---|---|---|",
    ]
    lines += [f"| {LABELS[r['arm']]} | {r['evaluated_with']} | {r['retain_mean']:.3f} ± {r['retain_se']:.3f} ({r['retain_std']:.3f}) |" for r in rows]
    lines += ["", f"The paper's ordering, evaluated with {results['trained_with']} (a step holds when the difference exceeds 2 SE;"
              " the last, `<=`, when it is not below -2 SE):", ""]
    lines += ordering_lines(rows, results["trained_with"])
    (out_dir / "retain_table.md").write_text("\n".join(lines) + "\n")
    csv = ["arm,trained_with,evaluated_with,retain_mean,retain_std,retain_se,seeds"]
    csv += [f"{r['arm']},{r['trained_with']},{r['evaluated_with']},{r['retain_mean']:.4f},{r['retain_std']:.4f},{r['retain_se']:.4f},{r['seeds']}" for r in rows]
    (out_dir / "retain_table.csv").write_text("\n".join(csv) + "\n")
    plot_curves(results, out_dir / "curves.png")


OBJECTIVES = {"sft": "cross-entropy", "fixed_prefix": "JSD", "sequence_kd": "cross-entropy", "teacher_prefix": "JSD",
              "lt_opd_no_curriculum": "JSD", "lt_opd": "JSD", "lt_opd_reverse_kl": "reverse KL"}


def plot_curves(results: dict, path: Path) -> list[str]:
    """Left: retain (headline selector) against update, mean over seeds with the seeds' min-max band; then one
    panel per arm with its own training loss (objectives differ: never on one axis). Returns the panel titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    selector, full = results["selectors"][0], results["teacher"]["full"]
    arms = list(dict.fromkeys(r["arm"] for r in results["runs"]))
    fig, axes = plt.subplots(1, 1 + len(arms), figsize=(5 * (1 + len(arms)), 4.2), squeeze=False)
    left, panels = axes[0][0], axes[0][1:]
    untrained = results["teacher"][selector] / full
    for arm, loss_axis in zip(arms, panels):
        curves = [r["curve"] for r in results["runs"] if r["arm"] == arm]
        evaluated = [p["step"] for p in curves[0] if p["eval"]]
        per_seed = [[next(p for p in c if p["step"] == s)["eval"][selector] / full for c in curves] for s in evaluated]
        line, = left.plot([0, *evaluated], [untrained, *map(statistics.fmean, per_seed)], marker="o", label=LABELS[arm])
        left.fill_between([0, *evaluated], [untrained, *map(min, per_seed)], [untrained, *map(max, per_seed)], color=line.get_color(), alpha=0.15)
        steps = [p["step"] for p in curves[0]]
        losses = [[c[i]["loss"] for c in curves] for i in range(len(steps))]
        loss_axis.plot(steps, list(map(statistics.fmean, losses)), color=line.get_color())
        loss_axis.fill_between(steps, list(map(min, losses)), list(map(max, losses)), color=line.get_color(), alpha=0.15)
        loss_axis.set(xlabel="update", ylabel=f"training loss ({OBJECTIVES.get(arm, arm)})", yscale="log", title=LABELS[arm])
    left.axhline(untrained, color="grey", linestyle=":", label="untrained")
    left.set(xlabel="update", ylabel=f"retain at {results['budget_bps'] / 100:g}% ({selector})",
             title=f"held-out retain ratio ({len(results['seeds'])} seeds: mean, min-max band)")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)  # below the axes, never over the curves
    for axis in axes[0]:
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [axis.get_title() for axis in axes[0]]
