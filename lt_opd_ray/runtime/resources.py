"""Refuse a job whose pools do not fit the cluster, before any actor starts."""

from __future__ import annotations

from ..config import JobConfig


class InsufficientResourcesError(RuntimeError):
    pass


def pool_sizes(job: JobConfig, largest: bool = False) -> dict[str, int]:
    """Actors per pool when the job starts (teacher: its initial `replicas`); `largest`: the teacher at
    `max_replicas`, as Serve's autoscaling may grow it when the cluster has room."""
    p = job.pools
    teacher = p.teacher.max_replicas if largest else p.teacher.replicas
    return {"rollout": p.rollout.workers, "teacher": teacher, "learner": p.learner.ranks}


def pool_demands(job: JobConfig, largest: bool = False) -> dict[str, dict[str, float]]:
    """Resources each pool reserves (at start, or at its largest size): CPU, GPU and its custom node resource."""
    demands = {}
    for pool, size in pool_sizes(job, largest).items():
        spec = getattr(job.pools, pool)
        demand = {"CPU": size * spec.cpus, "GPU": size * spec.gpus}
        demand.update({name: size * amount for name, amount in spec.ray_resources().items()})
        demands[pool] = demand
    return demands


def check_resources(job: JobConfig, cluster: dict[str, float]) -> None:
    """Raise naming each pool and the shortfall if the pools, as the job starts them, need more than the cluster has.

    Autoscaling headroom (teacher replicas above the initial count) never refuses a job: Serve adds a replica
    only where one fits (`autoscaling_note` says how far the cluster lets it grow)."""
    problems = shortfalls(pool_demands(job), cluster)
    if problems:
        raise InsufficientResourcesError(
            f"job {job.name!r} does not fit the cluster: " + "; ".join(problems)
            + ". Lower the pools' cpus / gpus (fractions such as 0.5 are fine) or size, or give the cluster more"
            " (`ray start --num-cpus N`, more nodes)"
        )


def autoscaling_note(job: JobConfig, cluster: dict[str, float]) -> str | None:
    """A line for the start-up output when the teacher cannot autoscale to max_replicas on this cluster."""
    teacher = job.pools.teacher
    start = pool_demands(job)
    per_replica = {resource: amount / teacher.replicas for resource, amount in start["teacher"].items() if amount}
    free = {resource: cluster.get(resource, 0.0) - sum(d.get(resource, 0.0) for d in start.values()) for resource in per_replica}
    extra = min((int(free[r] / per_replica[r] + 1e-9) for r in per_replica), default=teacher.max_replicas)
    reachable = min(teacher.max_replicas, teacher.replicas + max(extra, 0))
    if reachable == teacher.max_replicas:
        return None
    return (f"note: the teacher may autoscale to pools.teacher.max_replicas = {teacher.max_replicas}; this cluster has room for"
            f" {reachable} replica(s) beside the other pools, so Serve leaves the rest pending until nodes join")


def shortfalls(demands: dict[str, dict[str, float]], cluster: dict[str, float]) -> list[str]:
    """Each resource the pools together need more of than the cluster has, with every pool's part."""
    problems = []
    for resource in sorted({r for d in demands.values() for r in d}, key=lambda r: (r not in ("CPU", "GPU"), r)):
        need = sum(d.get(resource, 0.0) for d in demands.values())
        have = float(cluster.get(resource, 0.0))
        if need > have + 1e-9:
            parts = ", ".join(f"{pool} {d[resource]:g}" for pool, d in demands.items() if d.get(resource))
            problems.append(f"{resource}: the pools need {need:g} ({parts}) but the cluster has {have:g}, short by {need - have:g}")
    return problems
