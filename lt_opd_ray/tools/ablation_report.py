"""The toy ablation's report: retain per arm (and per kind of question, averaged over kinds as the paper averages
its benchmarks), the paper's ordering weighed step by step against its standard error, the arms the paper puts below
LT-OPD weighed the same way, each arm's share of the oracle's gap, whether each arm's curve has flattened, and the
curves."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

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
    "lt_opd_divprune": "LT-OPD trained with DivPrune",
    "lt_opd_hiprune": "LT-OPD trained with HiPrune",
    "lt_opd_no_hold": "LT-OPD, no final plateau",
    "grpo": "GRPO (answer reward)",
    "dapo": "DAPO (answer reward)",
    "gspo": "GSPO (answer reward)",
    "oracle_sft": "SFT on the true labels (oracle)",
    "oracle_sft_matched": "SFT on the true labels, compute-matched (oracle)",
}
ORACLE = "oracle_sft"  # the true labels at this selector and budget: the recoverable gap's measure (an estimate, not a proof)
RL_ARMS = ("grpo", "dapo", "gspo")  # their loss is ~0 by construction (centred advantages): their panel shows the reward


# the paper's ordering at 5% (68.6 < 70.4 < 77.6 < 81.5 <= 82.3)
PAPER_ORDER = ("untrained", "sft", "fixed_prefix", "lt_opd_no_curriculum", "lt_opd")


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


def kind_rows(results: dict) -> list[dict]:
    """Where the held-out rows ask several kinds of question: one row per (arm, eval selector) with retain on each
    kind (accuracy / the teacher's full-token accuracy on that kind) and its mean over the kinds, as the paper
    averages its benchmarks. Mean, std and standard error over seeds of each run's mean over kinds; the untrained
    student's standard error is the binomial one over each kind's items, carried through the mean."""
    teacher, sizes = results["teacher_by_kind"], results["kind_items"]
    kinds = list(teacher)

    def retain(accuracy: dict[str, dict[str, float]], kind: str, selector: str) -> float:
        return accuracy[kind][selector] / teacher[kind]["full"]

    rows = []
    for selector in results["selectors"]:
        by_kind = {k: retain(teacher, k, selector) for k in kinds}
        variance = sum(teacher[k][selector] * (1 - teacher[k][selector]) / sizes[k] / teacher[k]["full"] ** 2 for k in kinds) / len(kinds) ** 2
        rows.append({"arm": "untrained", "evaluated_with": selector, "by_kind": by_kind, "retain_mean": statistics.fmean(by_kind.values()),
                     "retain_std": 0.0, "retain_se": math.sqrt(variance), "seeds": 0})
    for arm in dict.fromkeys(r["arm"] for r in results["runs"]):
        runs = [r["final_by_kind"] for r in results["runs"] if r["arm"] == arm and "final_by_kind" in r]
        for selector in results["selectors"] if runs else ():
            per_seed = [statistics.fmean(retain(run, k, selector) for k in kinds) for run in runs]
            std = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
            rows.append({"arm": arm, "evaluated_with": selector, "by_kind": {k: statistics.fmean(retain(run, k, selector) for run in runs) for k in kinds},
                         "retain_mean": statistics.fmean(per_seed), "retain_std": std, "retain_se": std / math.sqrt(len(runs)), "seeds": len(runs)})
    return rows


def one_seed(*rows: dict) -> bool:
    """A trained arm with one run has no standard error (the untrained student's is binomial): nothing to weigh."""
    return any(r.get("seeds") == 1 for r in rows)


def retain_cell(r: dict) -> str:
    return f"{r['retain_mean']:.3f} (one seed)" if one_seed(r) else f"{r['retain_mean']:.3f} ± {r['retain_se']:.3f} ({r['retain_std']:.3f})"


def se_field(r: dict) -> str:
    return "" if one_seed(r) else f"{r['retain_se']:.4f}"  # one run: no standard error


def ordering_lines(rows: list[dict], selector: str) -> list[str]:
    """Each step of the paper's ordering on `selector`: the difference of means, its standard error, and whether it holds."""
    by_arm = {r["arm"]: r for r in rows if r["evaluated_with"] == selector}
    present = [arm for arm in PAPER_ORDER if arm in by_arm]
    lines = []
    for lower, upper in zip(present, present[1:]):
        a, b = by_arm[lower], by_arm[upper]
        difference, se = b["retain_mean"] - a["retain_mean"], math.hypot(a["retain_se"], b["retain_se"])
        strict = (lower, upper) != ("lt_opd_no_curriculum", "lt_opd")  # the paper's last step is "<=" (81.5 vs 82.3)
        relation = "<" if strict else "<="
        if one_seed(a, b):
            lines.append(f"- {LABELS[lower]} {relation} {LABELS[upper]}: difference {difference:+.3f}, one seed: not weighed")
            continue
        verdict = "holds" if (difference > 2 * se if strict else difference > -2 * se) else "does not hold"
        lines.append(f"- {LABELS[lower]} {relation} {LABELS[upper]}: difference {difference:+.3f} ± {se:.3f} (SE): {verdict}")
    return lines


# the paper's other claims: each RL baseline, and LT-OPD without its final plateau, below LT-OPD
BELOW_LT_OPD = (*RL_ARMS, "lt_opd_no_hold")


def below_lt_opd_lines(rows: list[dict], selector: str) -> list[str]:
    """Each arm of BELOW_LT_OPD that ran against LT-OPD on `selector`: d = LT-OPD - arm and SE(d) = hypot of their
    SEs; "shown" when d > 2 SE(d), "reversed" when d < -2 SE(d), "not shown" otherwise."""
    by_arm = {r["arm"]: r for r in rows if r["evaluated_with"] == selector}
    if "lt_opd" not in by_arm:
        return []
    lines = []
    for arm in (a for a in BELOW_LT_OPD if a in by_arm):
        d = by_arm["lt_opd"]["retain_mean"] - by_arm[arm]["retain_mean"]
        if one_seed(by_arm["lt_opd"], by_arm[arm]):
            lines.append(f"- {LABELS[arm]} < LT-OPD: d = {d:+.3f}, one seed: not weighed")
            continue
        se = math.hypot(by_arm["lt_opd"]["retain_se"], by_arm[arm]["retain_se"])
        verdict = "shown" if d > 2 * se else "reversed" if d < -2 * se else "not shown"
        lines.append(f"- {LABELS[arm]} < LT-OPD: d = {d:+.3f} ± {se:.3f} (SE): {verdict}")
    if not lines:
        return []
    return ["", f"Below LT-OPD, evaluated with {selector} (d = LT-OPD - arm; shown when d > 2 SE, reversed when d < -2 SE):", "", *lines]


def flatness(results: dict, arm: str, selector: str) -> dict | None:
    """Whether `arm`'s held-out curve on `selector` has flattened: per seed, d = the mean of its last two evaluations
    minus the mean of the two before them (retain, the teacher's full-token accuracy dividing); flat when |mean d| is
    within 2 standard errors of d over the seeds. None with fewer than two seeds or four evaluations a run."""
    full = results["teacher"]["full"]
    evaluated = [[p for p in r["curve"] if p.get("eval")] for r in results["runs"] if r["arm"] == arm]
    if len(evaluated) < 2 or min(map(len, evaluated)) < 4:
        return None
    d = [(e[-1]["eval"][selector] + e[-2]["eval"][selector]) / 2 / full - (e[-3]["eval"][selector] + e[-4]["eval"][selector]) / 2 / full
         for e in evaluated]
    se = statistics.stdev(d) / math.sqrt(len(d))
    return {"d": statistics.fmean(d), "se": se, "flat": abs(statistics.fmean(d)) <= 2 * se, "steps": [p["step"] for p in evaluated[0][-4:]]}


def flatness_lines(results: dict, selector: str) -> list[str]:
    """Each arm's flatness (see `flatness`), and the arms that have not flattened."""
    arms = list(dict.fromkeys(r["arm"] for r in results["runs"]))
    weighed = {arm: f for arm in arms if (f := flatness(results, arm, selector)) is not None}
    if not weighed:
        return []
    steps = next(iter(weighed.values()))["steps"]
    lines = ["", f"Curves until flat, evaluated with {selector}: per seed, the mean of the evaluations at updates {steps[2]} and"
             f" {steps[3]} minus the mean at {steps[0]} and {steps[1]}; flat when the mean over seeds is within 2 SE:", ""]
    lines += [f"- {LABELS[arm]}: {f['d']:+.3f} ± {f['se']:.3f} (SE): {'flat' if f['flat'] else 'not flat'}" for arm, f in weighed.items()]
    rising = [LABELS[arm] for arm, f in weighed.items() if not f["flat"]]
    return lines + ["", f"Not flat: {', '.join(rising)}." if rising else "Every arm's curve is flat."]


def gap_share_lines(rows: list[dict], selector: str) -> list[str]:
    """Where the oracle ran: each arm's share of the gap it recovers on `selector`, (arm - untrained) / (oracle -
    untrained), from the means; an arm may pass 100% (SFT on hard labels bounds no distillation). No shares where the
    oracle is not above the untrained student by 2 SE (nor, from one run, above it at all): a line says so."""
    by_arm = {r["arm"]: r for r in rows if r["evaluated_with"] == selector}
    if ORACLE not in by_arm:
        return []
    floor, top = by_arm["untrained"], by_arm[ORACLE]
    gap, se = top["retain_mean"] - floor["retain_mean"], math.hypot(top["retain_se"], floor["retain_se"])
    weighed = "one seed, not weighed" if one_seed(top) else f"± {se:.3f} SE"
    if gap <= (0.0 if one_seed(top) else 2 * se):
        return ["", f"{LABELS[ORACLE]} is not above the untrained student (difference {gap:+.3f} {weighed}, evaluated with"
                f" {selector}): no gap to take shares of."]
    lines = ["", f"Each arm's share of the gap {LABELS[ORACLE]} recovers, evaluated with {selector}: (arm - untrained) / (oracle -"
             f" untrained), the oracle at {top['retain_mean']:.3f}{' (one seed, the gap not weighed)' if one_seed(top) else ''},"
             f" untrained at {floor['retain_mean']:.3f}:", ""]
    return lines + [f"- {LABELS[arm]}: {(r['retain_mean'] - floor['retain_mean']) / gap:+.0%}" for arm, r in by_arm.items() if arm not in ("untrained", ORACLE)]


def untrained_on_validation(results: dict) -> str:
    """`; the untrained student's: <retain>` on the validation rows, with the selector trained with, where known."""
    teacher = results.get("validation", {}).get("teacher_by_kind")
    if not teacher:
        return ""
    selector = results["trained_with"]
    return f"; the untrained student's: {sum(a[selector] / a['full'] for a in teacher.values()) / len(teacher):.3f}"


def tuning_lines(results: dict) -> list[str]:
    """Each arm's validation retain at every scale of the job's learning rates, and the scale its seeds trained at."""
    scales, tuning = results.get("lr_scales"), results.get("tuning_runs", [])
    if not scales or not tuning:
        return []
    lines = ["", f"Learning rates chosen on validation rows ({results['validation']['rows']}, apart from the training and held-out"
             f" rows): retain with {results['trained_with']} averaged over the kinds, one run per scale of the job's learning rates;"
             " the arm's seeds trained at the chosen scale" + untrained_on_validation(results) + ".", "",
             "| arm | " + " | ".join(f"{scale:g}x" for scale in scales) + " | chosen |", "|---|" + "---|" * (len(scales) + 1)]
    for arm in dict.fromkeys(r["arm"] for r in tuning):
        score = {r["lr_scale"]: r["retain"] for r in tuning if r["arm"] == arm and not r.get("variant")}
        lines.append(f"| {LABELS[arm]} | " + " | ".join(f"{score[s]:.3f}" if s in score else "-" for s in scales)
                     + f" | {results['chosen_lr_scale'].get(arm, '-')}{'x' if arm in results['chosen_lr_scale'] else ''} |")
    varied = [r for r in tuning if r.get("variant")]
    if not varied:
        return lines
    variants = list(dict.fromkeys(r["variant"] for r in varied))
    lines += ["", "The RL arms' group size and clip range, tried at each arm's chosen learning rates (validation retain as above;"
              " `2x_group`: groups twice as large, half the prompts, the same responses an update; `0.5x_clip` / `2x_clip`: its"
              " paper's clip range halved / doubled); the arm's seeds trained with the chosen one.", "",
              "| arm | at | its own | " + " | ".join(variants) + " | chosen |", "|---|---|---|" + "---|" * (len(variants) + 1)]
    for arm, scale in dict.fromkeys((r["arm"], r["lr_scale"]) for r in varied):  # every scale variants ran at, chosen or not
        score = {r.get("variant"): r["retain"] for r in tuning if r["arm"] == arm and r["lr_scale"] == scale}
        chosen = results.get("chosen_variant", {}).get(arm, "-") if results["chosen_lr_scale"].get(arm) == scale else "-"
        lines.append(f"| {LABELS[arm]} | {scale:g}x | " + " | ".join(f"{score[v]:.3f}" if v in score else "-" for v in [None, *variants])
                     + f" | {chosen or 'its own'} |")  # None: its own settings
    return lines


def carried_choice_lines(results: dict) -> list[str]:
    """The scale (and RL variant) each arm trained with, where an earlier study chose them (`--choices-from`)."""
    carried = results.get("choices_from")
    if not carried:
        return []
    lines = ["", f"Learning rates (and the RL arms' settings: their own, or the variant chosen) as the study of {carried['results']}"
             f" chose them on its validation rows at {carried['steps']} updates per run; nothing was tuned again here.", "",
             "| arm | learning rates | RL settings |", "|---|---|---|"]
    for arm, scale in carried["lr_scale"].items():
        variant = (carried["variant"][arm] or "its own") if arm in carried["variant"] else "-"
        lines.append(f"| {LABELS[arm]} | {scale:g}x the job's | {variant} |")
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
        + f", mean ± standard error over {len({r['seed'] for r in results['runs']})} seed(s) run (std in brackets), {results['steps']} updates per run,"
        f" wall time {results['seconds'] / 60:.1f} min." + ("" if results.get("complete", True) else " PARTIAL: the study was cut short."),
        "",
        "| arm | evaluated with | retain |",
        "|---|---|---|",
    ]
    lines += [f"| {LABELS[r['arm']]} | {r['evaluated_with']} | {retain_cell(r)} |" for r in rows]
    ordered = rows
    if "teacher_by_kind" in results:
        ordered, kinds = kind_rows(results), list(results["teacher_by_kind"])
        lines += ["", "Retain by kind of question (each kind's accuracy / the teacher's full-token accuracy on it; the teacher: "
                  + ", ".join(f"{k} {a['full']:.3f} on {results['kind_items'][k]} items" for k, a in results["teacher_by_kind"].items())
                  + "), and its mean over the kinds, as the paper averages its benchmarks: mean ± SE over seeds (std in brackets).", "",
                  f"| arm | evaluated with | {' | '.join(kinds)} | mean over kinds |", "|---|---|" + "---|" * (len(kinds) + 1)]
        lines += [f"| {LABELS[r['arm']]} | {r['evaluated_with']} | " + " | ".join(f"{r['by_kind'][k]:.3f}" for k in kinds)
                  + f" | {retain_cell(r)} |" for r in ordered]
    lines += ["", f"The paper's ordering{' on the mean over kinds' if ordered is not rows else ''}, evaluated with {results['trained_with']}"
              " (a step holds when the difference exceeds 2 SE; the last, `<=`, when it is not below -2 SE):", ""]
    lines += ordering_lines(ordered, results["trained_with"])
    lines += below_lt_opd_lines(ordered, results["trained_with"])
    lines += gap_share_lines(ordered, results["trained_with"])
    lines += flatness_lines(results, results["trained_with"])
    lines += tuning_lines(results)
    lines += carried_choice_lines(results)
    (out_dir / "retain_table.md").write_text("\n".join(lines) + "\n")
    csv = ["arm,trained_with,evaluated_with,retain_mean,retain_std,retain_se,seeds"]
    csv += [f"{r['arm']},{r['trained_with']},{r['evaluated_with']},{r['retain_mean']:.4f},{r['retain_std']:.4f},{se_field(r)},{r['seeds']}" for r in rows]
    (out_dir / "retain_table.csv").write_text("\n".join(csv) + "\n")
    plot_curves(results, out_dir / "curves.png")


OBJECTIVES = {"sft": "cross-entropy", "fixed_prefix": "JSD", "sequence_kd": "cross-entropy", "teacher_prefix": "JSD",
              "lt_opd_no_curriculum": "JSD", "lt_opd": "JSD", "lt_opd_reverse_kl": "reverse KL", "lt_opd_no_hold": "JSD",
              "oracle_sft": "cross-entropy", "oracle_sft_matched": "cross-entropy"}


def plot_curves(results: dict, path: Path, retain=None, untrained: float | None = None, measure: str | None = None) -> list[str]:
    """Left: retain (headline selector) against update, mean over seeds with the seeds' min-max band; then one
    panel per arm with its own training loss (objectives differ: never on one axis). Returns the panel titles.
    `retain(entry)`: a curve entry's retain (None where the update was not evaluated), `untrained` the untrained
    student's, `measure` what they are: a plan's own definition (tools/study_plan.py); else accuracy / the teacher's
    full-token accuracy over all held-out items."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if retain is None:
        selector, full = results["selectors"][0], results["teacher"]["full"]
        retain, untrained = (lambda entry: entry["eval"][selector] / full if entry["eval"] else None), results["teacher"][selector] / full
        measure = f"retain at {results['budget_bps'] / 100:g}% ({selector})"
    arms = list(dict.fromkeys(r["arm"] for r in results["runs"]))
    fig, axes = plt.subplots(1, 1 + len(arms), figsize=(5 * (1 + len(arms)), 4.2), squeeze=False)
    left, panels = axes[0][0], axes[0][1:]
    for arm, loss_axis in zip(arms, panels):
        curves = [r["curve"] for r in results["runs"] if r["arm"] == arm]
        evaluated = [p["step"] for p in curves[0] if retain(p) is not None]
        per_seed = [[retain(next(p for p in c if p["step"] == s)) for c in curves] for s in evaluated]
        line, = left.plot([0, *evaluated], [untrained, *map(statistics.fmean, per_seed)], marker="o", label=LABELS[arm])
        left.fill_between([0, *evaluated], [untrained, *map(min, per_seed)], [untrained, *map(max, per_seed)], color=line.get_color(), alpha=0.15)
        steps = [p["step"] for p in curves[0]]
        shown = "reward" if arm in RL_ARMS else "loss"
        values = [[c[i][shown] for c in curves] for i in range(len(steps))]
        loss_axis.plot(steps, list(map(statistics.fmean, values)), color=line.get_color())
        loss_axis.fill_between(steps, list(map(min, values)), list(map(max, values)), color=line.get_color(), alpha=0.15)
        if arm in RL_ARMS:
            loss_axis.set(xlabel="update", ylabel="mean reward of the update's rollouts", title=LABELS[arm])
        else:
            loss_axis.set(xlabel="update", ylabel=f"training loss ({OBJECTIVES.get(arm, arm)})", yscale="log", title=LABELS[arm])
    left.axhline(untrained, color="grey", linestyle=":", label="untrained")
    left.set(xlabel="update", ylabel=measure,
             title=f"held-out retain ratio ({len({r['seed'] for r in results['runs']})} seeds: mean, min-max band)")  # those finished
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)  # below the axes, never over the curves
    for axis in axes[0]:
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [axis.get_title() for axis in axes[0]]
