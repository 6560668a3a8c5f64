"""The per-update timeline of a run (`steps.jsonl`'s spans) as a Gantt chart, one row per actor.

    lt-opd timeline runs/tiny                  # writes runs/tiny/timeline.png, prints busy fractions
    lt-opd timeline runs/tiny --last 3 --out t.png
"""

from __future__ import annotations

import json
from pathlib import Path

from lt_opd_ray.core.wire import Span, busy_seconds

ROLE_COLOURS = {"rollout": "tab:blue", "teacher": "tab:orange", "learner": "tab:green", "sync": "tab:red",
                "checkpoint": "tab:purple", "eval": "tab:gray"}
ROW_ORDER = ["rollout", "teacher", "learner", "sync", "checkpoint", "eval"]


def read_steps(run_dir: str | Path, last: int | None = None) -> list[dict]:
    """The run's step records (the last `last`, or all), each checked to carry a timeline."""
    path = Path(run_dir) / "steps.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass the run's checkpoint.dir (where `lt-opd train` writes steps.jsonl)")
    numbered = list(enumerate(path.read_text().splitlines(), start=1))
    steps = []
    for number, line in numbered[-last:] if last else numbered:
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not JSON ({exc.msg})") from None
        if "timeline" not in steps[-1]:
            raise ValueError(f"{path}, line {number}: no timeline (written by a version before timelines were recorded; try --last)")
    if not steps:
        raise ValueError(f"{path} holds no steps yet")
    return steps


def draw(steps: list[dict], out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [(step["step"], Span(**s)) for step in steps for s in step["timeline"]]
    origin = min(s.start for _, s in spans)
    rows = sorted({(s.role, s.actor) for _, s in spans}, key=lambda key: (ROW_ORDER.index(key[0]) if key[0] in ROW_ORDER else 99, key[1]))
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.6))
    for update, span in spans:
        y = rows.index((span.role, span.actor))
        ax.barh(y, span.seconds, left=span.start - origin, height=0.7, color=ROLE_COLOURS.get(span.role, "black"),
                alpha=0.55 + 0.45 * (update % 2), edgecolor="black", linewidth=0.3)
    for step in steps:  # where each update ended
        end = max(Span(**s).end for s in step["timeline"])
        ax.axvline(end - origin, color="black", linewidth=0.5, linestyle=":")
    ax.set_yticks(range(len(rows)), [f"{role}: {actor}" for role, actor in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first span shown (bars of alternate updates alternate in shade)")
    ax.set_title(f"updates {steps[0]['step']}-{steps[-1]['step']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120, metadata={"Software": DRAWN_BY})
    plt.close(fig)


DRAWN_BY = "lt-opd timeline"  # the PNG's Software text: a chart this command may redraw


def out_problem(out: Path) -> str | None:
    """Why `out` may not be written (a folder, a folder that does not exist, a file the command did not draw), or None."""
    if out.is_dir():
        return f"{out} is a folder; --out names the PNG file to draw"
    if not out.parent.is_dir():
        return f"{out.parent} does not exist; --out names a PNG file in an existing folder"
    if out.exists():
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(out) as image:
                drawn = image.info.get("Software") == DRAWN_BY
        except (OSError, UnidentifiedImageError):
            drawn = False
        if not drawn:
            return f"{out} exists and is not a chart lt-opd timeline drew: it is left alone; choose another --out"
    return None


POOLS = ("rollout", "teacher", "learner")


def window_busy(steps: list[dict]) -> list[dict[str, float]]:
    """Per update: each pool's busy fraction over that update's window (from the previous update's end to its own),
    counting every recorded span that overlaps the window, whichever update it belongs to, clipped to the window,
    over the pool's actors seen in the run. Exact where `PhaseTimes.busy` (the update's own work / its period) is
    not: with max_staleness 1 an update's rollouts run in the previous update's window."""
    spans = [Span(**s) for step in steps for s in step["timeline"]]
    actors = {pool: len({s.actor for s in spans if s.role == pool}) or 1 for pool in POOLS}
    ends = [max(Span(**s).end for s in step["timeline"]) for step in steps]
    starts = [ends[0] - steps[0]["phases"]["step"], *ends[:-1]]
    busy = []
    for start, end in zip(starts, ends):
        clipped = lambda pool: busy_seconds([s for s in spans if s.role == pool], start, end)  # noqa: E731
        busy.append({pool: clipped(pool) / (actors[pool] * (end - start)) for pool in POOLS})
    return busy


def busy_lines(steps: list[dict]) -> list[str]:
    lines = [f"{'update':>6} {'step s':>8} " + " ".join(f"{pool + ' busy':>13}" for pool in POOLS)]
    for step, busy in zip(steps, window_busy(steps)):
        lines.append(f"{step['step']:>6} {step['phases']['step']:>8.2f} " + " ".join(f"{busy[pool]:>13.2f}" for pool in POOLS))
    return lines
