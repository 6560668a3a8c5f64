"""Every kind of pre-registered plan `lt-opd ablation --plan` reads: a contrast of two arms (tools/study_plan.py) or,
with `kind: cross`, a selector cross (tools/cross_plan.py); and the verdict of each, from the plan a study recorded."""

from __future__ import annotations

from pathlib import Path

from lt_opd_ray.tools.cross_plan import CrossPlan, write_cross_verdict
from lt_opd_ray.tools.study_plan import StudyPlan, load_plan, write_verdict

KINDS = {"cross": CrossPlan}


def read_plan(path: str | Path) -> StudyPlan | CrossPlan:
    """The plan in `path`, of the kind it names; a ValueError naming the file and the field otherwise."""
    return load_plan(path, KINDS)


def write_plan_verdict(results: dict, out_dir: Path) -> dict:
    """The verdict of the plan `results` recorded (results["plan"]), of its kind, written into `out_dir`."""
    if results["plan"].get("kind") == "cross":
        return write_cross_verdict(results, CrossPlan.model_validate(results["plan"]), out_dir)
    return write_verdict(results, StudyPlan.model_validate(results["plan"]), out_dir)
