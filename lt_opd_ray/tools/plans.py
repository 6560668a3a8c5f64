"""Every kind of pre-registered plan `lt-opd ablation --plan` reads: a contrast of two arms (tools/study_plan.py) or,
with `kind: cross`, a selector cross (tools/cross_plan.py)."""

from __future__ import annotations

from pathlib import Path

from lt_opd_ray.tools.cross_plan import CrossPlan
from lt_opd_ray.tools.study_plan import StudyPlan, load_plan

KINDS = {"cross": CrossPlan}


def read_plan(path: str | Path) -> StudyPlan | CrossPlan:
    """The plan in `path`, of the kind it names; a ValueError naming the file and the field otherwise."""
    return load_plan(path, KINDS)
