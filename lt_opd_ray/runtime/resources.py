"""Refuse a job whose pools do not fit the cluster, before any actor starts."""

from __future__ import annotations

import os
import socket

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.wire import ActorPlacement, payload_bytes_per_position


class InsufficientResourcesError(RuntimeError):
    pass


def pool_sizes(job: JobConfig, largest: bool = False) -> dict[str, int]:
    """Actors per pool when the job starts (teacher: its initial `replicas`, none where the objective reads no teacher
    scores; the reward judge's replicas where reward.name is judge); `largest`: the Serve pools at `max_replicas`, as
    Serve's autoscaling may grow them when the cluster has room."""
    p = job.pools
    teacher = (p.teacher.max_replicas if largest else p.teacher.replicas) if job.objective.teacher_scores else 0
    sizes = {"rollout": p.rollout.workers, "teacher": teacher, "learner": p.learner.ranks}
    if job.reward.uses_judge:
        sizes["reward"] = p.reward.max_replicas if largest else p.reward.replicas
    return sizes


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


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one: a container's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_local_machine(job: JobConfig, cpus: int) -> None:
    """Before a local cluster starts: the pools' CPUs and custom resources against this machine (which has `cpus`
    CPUs and no custom resource), so a job sized for a cluster is refused at once, naming the shortfall, instead of
    Ray being asked for actors it can never place. GPUs are checked once Ray has detected them (preflight)."""
    demands = {pool: {r: amount for r, amount in demand.items() if r != "GPU"} for pool, demand in pool_demands(job).items()}
    if problems := shortfalls(demands, {"CPU": float(cpus)}):
        raise InsufficientResourcesError(
            f"job {job.name!r} does not fit this machine (a local Ray cluster of its {cpus} CPUs): " + "; ".join(problems)
            + ". Lower the pools' cpus (fractions such as 0.5 share a core) or size, or run on a cluster (--address, RAY_ADDRESS)"
        )


def check_export_port(job: JobConfig) -> None:
    """Before a local cluster starts: its metrics port free on this machine. Ray's metrics agent binds
    metrics.export_port and, finding it taken, ends the node, which Ray reports as a start-up timeout that names
    neither the port nor the field (seen with a second run beside another)."""
    port = job.metrics.export_port
    for address in ("0.0.0.0", "127.0.0.1"):  # Ray binds every interface, or loopback where that is the node's address
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Ray's HTTP server binds: a closed run's TIME_WAIT is free
            try:
                probe.bind((address, port))
            except OSError as exc:
                raise InsufficientResourcesError(
                    f"job {job.name!r} exports its metrics on metrics.export_port {port}, which another program on this machine"
                    f" holds ({exc.strerror}; another run's Ray cluster, or Prometheus): stop it, or give this run a port of its"
                    f" own (metrics.export_port in the job's YAML; lt-opd train also takes --set metrics.export_port=N)"
                ) from None


def autoscaling_note(job: JobConfig, cluster: dict[str, float]) -> str | None:
    """A line for the start-up output when the teacher cannot autoscale to max_replicas on this cluster."""
    teacher = job.pools.teacher
    if not job.objective.teacher_scores:
        return None
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


def payload_bytes_in_flight(job: JobConfig) -> int:
    """The most teacher-payload bytes the object store holds at once: every response of the updates in flight
    (1 + max_staleness) at max_new_tokens positions (payloads dwarf the rollouts' token ids); none without a teacher."""
    if not job.objective.teacher_scores:
        return 0
    s = job.sampling
    positions = (1 + job.schedule.max_staleness) * s.prompts_per_step * s.n * s.max_new_tokens
    return positions * payload_bytes_per_position(job.objective.top_k, job.pools.teacher.payload_dtype)


def check_memory(job: JobConfig, cluster: dict[str, float]) -> None:
    """Refuse a job whose updates in flight need more object-store memory than the cluster has (Ray's
    `object_store_memory`, summed over its nodes), naming the fields that set the size."""
    need, have = payload_bytes_in_flight(job), cluster.get("object_store_memory", 0.0)
    if need > have:
        s = job.sampling
        raise InsufficientResourcesError(
            f"job {job.name!r} needs up to {need / 1e9:.1f} GB of teacher payloads in flight (sampling.prompts_per_step"
            f" {s.prompts_per_step} x n {s.n} x max_new_tokens {s.max_new_tokens} x {1 + job.schedule.max_staleness} update(s),"
            f" {payload_bytes_per_position(job.objective.top_k, job.pools.teacher.payload_dtype)} B per position at objective.top_k"
            f" {job.objective.top_k}) but the cluster's object store holds {have / 1e9:.1f} GB: lower those sizes, set"
            " pools.teacher.payload_dtype: float16, or give the cluster more memory"
        )


# Ray's accelerator_type resource of a node's NVIDIA GPUs -> the planner's GPU (its memory)
ACCELERATOR_TYPES = {"A100-80G": "a100", "A100": "a100", "A100-40G": "a100-40gb", "H100": "h100", "H200": "h200"}


def learner_state_bytes(job: JobConfig, model_config: dict) -> float:
    """What one learner rank holds whatever its batch: weights, gradients, fp32 master weights and Adam's moments,
    each whole or split over the ranks as the job's ZeRO stage keeps them (planner.LEARNER_BYTES_PER_PARAM)."""
    from lt_opd_ray.planning.planner import LEARNER_BYTES_PER_PARAM, parameter_count

    ranks = job.pools.learner.ranks
    per_param = sum(whole + part / ranks for whole, part in LEARNER_BYTES_PER_PARAM[job.pools.learner.zero_stage].values())
    return per_param * parameter_count(model_config)


def largest_gpu_bytes(nodes: list[dict]) -> float | None:
    """Memory of the largest GPU the live nodes name (`accelerator_type:*`, Ray's NVIDIA names); None when none is named."""
    from lt_opd_ray.planning.planner import GPUS

    types = {name.split(":", 1)[1] for node in nodes if node.get("Alive", True) for name in node.get("Resources", {})
             if name.startswith("accelerator_type:")}
    memory = [GPUS[ACCELERATOR_TYPES[t]].memory_gb * 1e9 for t in types if t in ACCELERATOR_TYPES]
    return max(memory) if memory else None


def check_engine_memory(job: JobConfig, model_config: dict, nodes: list[dict]) -> None:
    """Refuse a job whose vLLM engines (on GPUs) cannot hold the model's weights and one sequence of the job's longest
    length (`planner.context_length`, the engines' max_model_len) in their share of the GPU (gpu_memory_utilization),
    which vLLM refuses only after loading. Activations and CUDA graphs are not counted: a refusal here is certain."""
    from lt_opd_ray.planning.efficiency import cache_bytes
    from lt_opd_ray.planning.planner import DTYPE_BYTES, context_length, parameter_count

    gpu = largest_gpu_bytes(nodes)
    try:
        weights = parameter_count(model_config) * DTYPE_BYTES[job.model.dtype]
        length = context_length(job, model_config)
        kv, state = cache_bytes(model_config, length, DTYPE_BYTES[job.model.dtype])
    except KeyError:  # a layout the planner does not know: not checked here
        return
    for role, pool in (("rollout", job.pools.rollout), ("teacher", job.pools.teacher)):
        if pool.backend != "vllm" or pool.gpus == 0 or gpu is None or (role == "teacher" and not job.objective.teacher_scores):
            continue
        share = pool.vllm.gpu_memory_utilization * gpu
        if weights + kv + state > share:
            raise InsufficientResourcesError(
                f"job {job.name!r}: pools.{role}'s vLLM engine needs {weights / 1e9:.1f} GB of weights and {(kv + state) / 1e9:.2f} GB of KV"
                f" cache for one {length}-token sequence (data.max_pixels {job.data.max_pixels}, sampling.max_new_tokens"
                f" {job.sampling.max_new_tokens}), more than its {share / 1e9:.1f} GB (pools.{role}.vllm.gpu_memory_utilization"
                f" {pool.vllm.gpu_memory_utilization:g} of this cluster's largest GPU, {gpu / 1e9:.0f} GB): a larger share, fewer"
                " pixels, or GPUs with more memory")


def check_learner_memory(job: JobConfig, model_config: dict, nodes: list[dict]) -> None:
    """Refuse a job whose learner ranks cannot hold their state (activations not counted: a refusal here is certain
    to be right): on GPUs, one rank's state against the memory of the largest GPU the cluster's nodes name
    (`accelerator_type:*`; unnamed GPUs are not checked); on CPUs, against the largest node's memory, with every rank
    on that node where the cluster has one node. `nodes`: `ray.nodes()`."""
    pool = job.pools.learner
    try:
        state = learner_state_bytes(job, model_config)
    except KeyError:  # a layout the planner does not know: not checked here
        return
    resources = [node.get("Resources", {}) for node in nodes if node.get("Alive", True)]
    if pool.gpus > 0:
        gpu = largest_gpu_bytes(nodes)
        if gpu is not None and state * pool.gpus > gpu:  # a rank with gpus < 1 shares its GPU with others
            raise InsufficientResourcesError(
                f"job {job.name!r}: a learner rank's weights, gradients and optimizer state take {state / 1e9:.1f} GB under ZeRO-{pool.zero_stage}"
                f" over {pool.ranks} rank(s), more than the {gpu / 1e9:.0f} GB of this cluster's largest GPU: more ranks, ZeRO-3,"
                " or GPUs with more memory (`lt-opd plan` sizes them)")
        return
    memory = [r.get("memory", 0.0) for r in resources]
    ranks_on_a_node = pool.ranks if len(resources) == 1 else 1
    if memory and state * ranks_on_a_node > max(memory):
        raise InsufficientResourcesError(
            f"job {job.name!r}: {ranks_on_a_node} CPU learner rank(s) on one node hold {state * ranks_on_a_node / 1e9:.1f} GB of weights,"
            f" gradients and optimizer state under ZeRO-{pool.zero_stage}, more than the {max(memory) / 1e9:.1f} GB of memory Ray"
            " gives the node: more nodes, ZeRO-3 over more ranks, or a smaller model")


def placement_here(actor: str, engine: str, missing_kernels: tuple[str, ...] = ()) -> ActorPlacement:
    """The calling actor's placement: its node and the GPU ids Ray gave it."""
    import ray

    context = ray.get_runtime_context()
    gpus = tuple(str(g) for g in context.get_accelerator_ids().get("GPU", ()))
    return ActorPlacement(actor, context.get_node_id(), gpus, engine, missing_kernels)


def first_torch_seed() -> int:
    """The seed of this process's torch generators, read before anything seeds them (`restart_torch_generators`)."""
    import torch

    return torch.initial_seed()


def restart_torch_generators(seed: int) -> None:
    """torch's generators (CPU and every GPU's) back where a new process starts them: a kept actor's next run draws
    what it would draw in a new process."""
    import torch

    torch.manual_seed(seed)


def free_run_memory() -> None:
    """What a finished run's engines held, given back now (DeepSpeed's engines hold reference cycles, which only the
    collector frees), GPU caches included."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
