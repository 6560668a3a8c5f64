"""Refuse a job whose pools do not fit the cluster, before any actor starts."""

from __future__ import annotations

from ..config import JobConfig


class InsufficientResourcesError(RuntimeError):
    pass


def pool_sizes(job: JobConfig) -> dict[str, int]:
    """Actors per pool at its largest (teacher: max_replicas, as autoscaling may reach it)."""
    p = job.pools
    return {"rollout": p.rollout.workers, "teacher": p.teacher.max_replicas, "learner": p.learner.ranks}


def pool_demands(job: JobConfig) -> dict[str, dict[str, float]]:
    """Resources each pool reserves at its largest size: CPU, GPU and its custom node resource."""
    demands = {}
    for pool, size in pool_sizes(job).items():
        spec = getattr(job.pools, pool)
        demand = {"CPU": size * spec.cpus, "GPU": size * spec.gpus}
        demand.update({name: size * amount for name, amount in spec.ray_resources().items()})
        demands[pool] = demand
    return demands


def check_resources(job: JobConfig, cluster: dict[str, float]) -> None:
    """Raise naming each pool and the shortfall if the pools together need more than the cluster has."""
    demands = pool_demands(job)
    problems = []
    for resource in sorted({r for d in demands.values() for r in d}, key=lambda r: (r not in ("CPU", "GPU"), r)):
        need = sum(d.get(resource, 0.0) for d in demands.values())
        have = float(cluster.get(resource, 0.0))
        if need > have + 1e-9:
            parts = ", ".join(f"{pool} {d[resource]:g}" for pool, d in demands.items() if d.get(resource))
            problems.append(f"{resource}: the pools need {need:g} ({parts}) but the cluster has {have:g}, short by {need - have:g}")
    if problems:
        raise InsufficientResourcesError(
            f"job {job.name!r} does not fit the cluster: " + "; ".join(problems)
            + ". Lower the pools' cpus / gpus (fractions such as 0.5 are fine) or size, or give the cluster more"
            " (`ray start --num-cpus N`, more nodes)"
        )
