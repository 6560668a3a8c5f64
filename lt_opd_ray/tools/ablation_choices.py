"""What a study chose on its validation rows (each arm's learning-rate scale, each RL arm's variant), carried from an
earlier study, and what a cut-short study already finished: the choices `lt-opd ablation` reads before it trains."""

from __future__ import annotations

import json
from pathlib import Path

from lt_opd_ray.tools.ablation_report import RL_ARMS


def chosen_lr_scale(tuning: list[dict], arm: str, lr_scales: list[float]) -> float:
    """The scale of `arm`'s highest validation retain among its runs without a variant; a tie goes to the scale
    listed first."""
    scored = [r for r in tuning if r["arm"] == arm and not r.get("variant") and r["lr_scale"] in lr_scales]
    return max(scored, key=lambda r: (r["retain"], -lr_scales.index(r["lr_scale"])))["lr_scale"]


def grid_ends(tuning: list[dict], chosen: dict[str, float], lr_scales: list[float]) -> dict[str, float]:
    """The arms whose chosen scale is the smallest or largest of a grid of several, scoring strictly above every other
    scale (a tie with an inner scale leaves nothing to look for beyond the end)."""
    ends = {}
    for arm, scale in chosen.items():
        if len(lr_scales) < 2 or scale not in (min(lr_scales), max(lr_scales)):
            continue
        score = {r["lr_scale"]: r["retain"] for r in tuning if r["arm"] == arm and not r.get("variant") and r["lr_scale"] in lr_scales}
        if all(score[scale] > retain for other, retain in score.items() if other != scale):
            ends[arm] = scale
    return ends


def chosen_variant(tuning: list[dict], arm: str, scale: float, variants: list[str]) -> str | None:
    """The one of `variants` with `arm`'s highest validation retain at `scale`, None (its own settings) where they
    scored highest; a tie goes to its own settings, then to the variant listed first."""
    order = [None, *variants]
    scored = [r for r in tuning if r["arm"] == arm and r["lr_scale"] == scale and r.get("variant") in order]
    return max(scored, key=lambda r: (r["retain"], -order.index(r.get("variant")))).get("variant") if scored else None


CHOSEN_AS = {"lt_opd_divprune": "lt_opd", "lt_opd_hiprune": "lt_opd"}  # arms that differ from lt_opd in their selector alone


def carried_choices(path: str, base_path: str, base, arms: list[str]) -> dict:
    """What the study of `path` (its results.json) chose on validation rows for each of `arms` (an arm of CHOSEN_AS
    that study did not tune: its like's): {"results": path, "steps": its updates, "lr_scale": {arm: scale}, "variant":
    {RL arm: variant or None}}. A ValueError where it is a
    study of another task, budget or selectors, or did not finish choosing for an arm (an arm it did not tune, an end
    of its grid it stopped at, an RL arm whose variants it did not try to the end)."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--choices-from {path}: not a study's results.json ({exc})") from exc
    if not isinstance(earlier, dict) or "steps" not in earlier:
        raise ValueError(f"--choices-from {path}: not a study's results.json (no study's fields in it)")
    # each arm's choice was scored with the selector it trained with: the selectors evaluated beside it do not change it
    wanted = {"base_job": base_path, "budget_bps": base.eval_budget_bps, "trained_with": base.selector.name}
    if differing := [f"{key} {earlier.get(key)!r} (here {value!r})" for key, value in wanted.items() if earlier.get(key) != value]:
        raise ValueError(f"--choices-from {path}: a study of another task ({'; '.join(differing)}); its choices do not carry over")
    if ends := earlier.get("grid_ends"):
        raise ValueError(f"--choices-from {path}: that study stopped at an end of its learning-rate grid ("
                         + ", ".join(f"{arm} {scale:g}x" for arm, scale in ends.items()) + "); extend its grid and resume it first")
    chosen = earlier.get("chosen_lr_scale", {}) if earlier.get("lr_scales") else {}
    chosen = chosen | {arm: chosen[like] for arm, like in CHOSEN_AS.items() if like in chosen and arm not in chosen}
    if untuned := [arm for arm in arms if arm not in chosen]:
        raise ValueError(f"--choices-from {path}: no learning rates chosen on validation rows for {', '.join(untuned)}")
    variants = earlier.get("chosen_variant", {})
    if earlier.get("rl_variants") and (untried := [arm for arm in arms if arm in RL_ARMS and arm not in variants]):
        raise ValueError(f"--choices-from {path}: no RL variant chosen for {', '.join(untried)} (that study stopped before"
                         " its variants were all tried); resume it first")
    return {"results": path, "steps": earlier["steps"], "lr_scale": {arm: chosen[arm] for arm in arms},
            "variant": {arm: variants.get(arm) for arm in arms if arm in RL_ARMS}}


def same_choices(before: dict | None, now: dict | None) -> bool:
    """Whether a resumed study trains at the choices its finished runs trained at: carried from no study in both, or
    from a study of the same length with the same scale and variant for every arm both name (arms may be added; the
    file may be named another way)."""
    if before is None or now is None:
        return before is now
    return before["steps"] == now["steps"] and all(
        before[key][arm] == now[key][arm] for key in ("lr_scale", "variant") for arm in before[key].keys() & now[key].keys())


def finished_study(out_dir: Path, base_path: str, steps: int, base, lr_scales: list[float] | None, rl_variants: list[str] = (),
                   carried: dict | None = None, eval_every: int | None = None, plan: dict | None = None) -> dict:
    """What a cut-short study in `out_dir` finished (its "runs" and "tuning_runs"), when it is this study; a
    ValueError naming the difference otherwise (a resumed study never mixes runs of another)."""
    path = out_dir / "results.json"
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    wanted = {"base_job": base_path, "steps": steps, "budget_bps": base.eval_budget_bps, "selectors": list(base.eval.selectors),
              "trained_with": base.selector.name, "lr_scales": lr_scales, "rl_variants": list(rl_variants), "eval_rows": base.eval.data,
              "eval_every": eval_every, "plan": plan}
    earlier.setdefault("rl_variants", [])  # a study from before RL variants existed tried none
    earlier.setdefault("eval_rows", base.eval.data)  # nor other evaluation rows than the job's, at its own interval
    earlier.setdefault("eval_every", None)
    earlier.setdefault("plan", None)  # a study under no plan
    if not earlier.get("runs"):  # no seed trained yet: the tuning may grow (more scales, more variants); its runs are kept
        for key in ("lr_scales", "rl_variants"):
            before, now = earlier.get(key), wanted[key]
            if before is not None and now and set(before) < set(now):
                wanted[key] = before
    differing = [f"{key} {earlier.get(key)!r} (now {value!r})" for key, value in wanted.items() if earlier.get(key) != value]
    if not same_choices(earlier.get("choices_from"), carried):
        choices = lambda carried: carried and {key: value for key, value in carried.items() if key != "results"}  # noqa: E731
        differing.append(f"choices carried over {choices(earlier.get('choices_from'))!r} (now {choices(carried)!r})")
    if differing:
        seeded = " after its seeds trained with the settings it chose" if earlier.get("runs") and earlier.get("lr_scales") else ""
        raise ValueError(f"{path}: another study ({'; '.join(differing)}{seeded}); resume it with its own settings or choose another --out")
    return earlier


def finished_seconds(out_dir: Path) -> float:
    return float(json.loads((out_dir / "results.json").read_text())["seconds"])
