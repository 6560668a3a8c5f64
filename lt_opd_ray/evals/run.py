"""`lt-opd eval`: a model at full tokens and at budgets, with selectors, over local benchmarks -> the retain table.

Every benchmark file is read and checked before any model runs. The full-token
score (every visual token, no selector) is computed once per benchmark; each
(selector, budget) score is divided by it and averaged over benchmarks (a
benchmark whose full-token score is 0 has no retain ratio: it is listed, not
averaged). Results go to a folder assembled beside `out` and renamed into place
(`core.outputs`: an existing `out` is replaced only with `force` and only when an earlier eval wrote it):
results.json, retain_table.md / .csv, retain.png (retain ratio against budget).
"""

from __future__ import annotations

import json
from pathlib import Path

from lt_opd_ray.core.curriculum import BPS
from lt_opd_ray.core.outputs import OutputFolder
from lt_opd_ray.core.samples import DEFAULT_FRAMES
from lt_opd_ray.evals.benchmarks import benchmark
from lt_opd_ray.evals.scoring import retain_ratio


def run_eval(model_path: str, files: dict[str, str], budgets: list[int], selectors: list[str], out: str | Path,
             k_min: int = 1, max_new_tokens: int = 16, limit: int | None = None, log=print, frames: int = DEFAULT_FRAMES,
             force: bool = False) -> dict:
    """`frames`: what each video is sampled to (MVBench: 16). `force`: replace an earlier eval's results in `out`."""
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.evaluation import generate_responses
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import VLMProcessor
    from lt_opd_ray.core.model_files import check_model_folder
    from lt_opd_ray.sources.resolve import resolve_model_dir

    destination = OutputFolder(Path(out), "eval", force)
    destination.check()  # before any model runs
    model_dir = resolve_model_dir(model_path)  # a missing model folder is named before anything is read
    for name in selectors:
        build_selector(name)  # unknown selectors fail before anything runs
    suites = {}
    for name, path in files.items():
        adapter = benchmark(name)
        suites[name] = (adapter, adapter.load(path)[:limit])
    check_model_folder(model_dir)  # a file cut short is named here, not met inside the loader
    model_dir, model = load_vlm(model_dir)
    vlm, processor = QwenVLM(model.eval()), VLMProcessor(model_dir, frames=frames)
    for name in selectors:
        vlm.check_selector(build_selector(name))  # a selector the model cannot run, before any benchmark

    def score(adapter, items, budget_bps, selector):
        responses = generate_responses(vlm, processor, [i.sample for i in items], budget_bps, selector, k_min,
                                       max_new_tokens=max_new_tokens)
        return adapter.score(items, responses), responses

    results = {"model": str(model_path), "k_min": k_min, "benchmarks": {}, "retain": {}}
    for name, (adapter, items) in suites.items():
        full, _ = score(adapter, items, BPS, selectors[0])
        entry = {"headline": adapter.headline, "items": len(items), "full": full, "pruned": {}}
        for selector in selectors:
            for budget in budgets:
                metrics, _ = score(adapter, items, budget, selector)
                entry["pruned"][f"{selector}@{budget}"] = metrics
                log(f"{name}: {selector} at {budget / 100:g}%: {metrics['score']:.2f} (full {full['score']:.2f})")
        results["benchmarks"][name] = entry
    for selector in selectors:
        for budget in budgets:
            key = f"{selector}@{budget}"
            scored = {n: e["full"]["score"] for n, e in results["benchmarks"].items() if e["full"]["score"] > 0}
            at_budget = {n: results["benchmarks"][n]["pruned"][key]["score"] for n in scored}
            results["retain"][key] = {
                "retain": retain_ratio(at_budget, scored) if scored else None,
                "per_benchmark": {n: at_budget[n] / scored[n] for n in scored},
                "without_full_score": sorted(set(results["benchmarks"]) - set(scored)),
            }
    staging = destination.staging()
    try:
        _write(results, selectors, budgets, staging)
        destination.publish(staging)
    except BaseException:
        destination.discard(staging)
        raise
    return results


def _write(results: dict, selectors: list[str], budgets: list[int], staging: Path) -> None:
    (staging / "results.json").write_text(json.dumps(results, indent=2))
    names = list(results["benchmarks"])
    header = ["selector", "budget"] + [f"{n} ({results['benchmarks'][n]['headline']})" for n in names] + ["avg retain"]
    rows = [["full tokens", "100%"] + [f"{results['benchmarks'][n]['full']['score']:.2f}" for n in names] + ["1.000"]]
    for selector in selectors:
        for budget in budgets:
            key = f"{selector}@{budget}"
            retain = results["retain"][key]
            cells = []
            for n in names:
                score = results["benchmarks"][n]["pruned"][key]["score"]
                ratio = retain["per_benchmark"].get(n)
                cells.append(f"{score:.2f} ({ratio:.3f})" if ratio is not None else f"{score:.2f} (n/a)")
            average = f"{retain['retain']:.3f}" if retain["retain"] is not None else "n/a"
            rows.append([selector, f"{budget / 100:g}%"] + cells + [average])
    (staging / "retain_table.md").write_text(
        "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n" + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    )
    (staging / "retain_table.csv").write_text("\n".join(",".join(f'"{c}"' for c in r) for r in [header] + rows) + "\n")
    _plot(results, selectors, budgets, staging / "retain.png")


def _plot(results: dict, selectors: list[str], budgets: list[int], path: Path) -> list[str]:
    """retain.png; returns the notes written on it (a selector whose retain is undefined says why, not a blank plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(5, 3.5))
    notes = []
    for selector in selectors:
        points = [(b / 100, results["retain"][f"{selector}@{b}"]["retain"]) for b in sorted(budgets)]
        points = [(x, y) for x, y in points if y is not None]
        if points:
            axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=selector)
        else:
            notes.append(f"{selector}: retain undefined, the full-token score is 0 on every benchmark")
    if notes:
        axis.text(0.5, 0.5, "\n".join(notes), transform=axis.transAxes, ha="center", va="center", fontsize=8, wrap=True)
    axis.set_xlabel("visual tokens kept (%)")
    axis.set_ylabel("average retain ratio")
    axis.axhline(1.0, color="grey", lw=0.5)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(notes) < len(selectors):
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return notes
