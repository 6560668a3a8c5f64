"""Refuse a job whose pools do not fit the cluster, before any actor starts."""

from __future__ import annotations

from ..config import JobConfig


class InsufficientResourcesError(RuntimeError):
    pass


def pool_demands(job: JobConfig) -> dict[str, dict[str, float]]:
    """CPU/GPU each pool reserves at its largest size (teacher: max_replicas, as autoscaling may reach it)."""
    p = job.pools
    return {
        "rollout": {"CPU": p.rollout.workers * p.rollout.cpus, "GPU": p.rollout.workers * p.rollout.gpus},
        "teacher": {"CPU": p.teacher.max_replicas * p.teacher.cpus, "GPU": p.teacher.max_replicas * p.teacher.gpus},
        "learner": {"CPU": p.learner.ranks * p.learner.cpus, "GPU": p.learner.ranks * p.learner.gpus},
    }


def check_resources(job: JobConfig, cluster: dict[str, float]) -> None:
    """Raise naming each pool and the shortfall if the pools together need more than the cluster has."""
    demands = pool_demands(job)
    problems = []
    for resource in ("CPU", "GPU"):
        need = sum(d[resource] for d in demands.values())
        have = float(cluster.get(resource, 0.0))
        if need > have + 1e-9:
            parts = ", ".join(f"{pool} {d[resource]:g}" for pool, d in demands.items() if d[resource])
            problems.append(f"{resource}: the pools need {need:g} ({parts}) but the cluster has {have:g}, short by {need - have:g}")
    if problems:
        raise InsufficientResourcesError(f"job {job.name!r} does not fit the cluster: " + "; ".join(problems))
