"""Independent scaling of the pools on CPU: each pool's throughput follows its own size,
and the teacher deployment autoscales with its queue within the YAML's bounds.

    python benchmarks/bench_scaling.py

Rollout: one batch of prompts split over W rollout workers (W = 1, 2), teacher fixed.
Teacher: the same rollout groups scored through R replicas (R = 1, 2), rollout fixed.
Autoscaling: min 1 / max 2 replicas, a burst of concurrent requests, replicas sampled
every second. Each actor uses one CPU thread (Ray sets OMP_NUM_THREADS from num_cpus),
so on this 2-core machine 2 is the most a pool can use in parallel.
"""

from __future__ import annotations

import argparse
import time

import ray

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.runtime.launch import WORKER_ENV
from lt_opd_ray.runtime.rollout_pool import RolloutPool
from lt_opd_ray.runtime.teacher import TeacherService
from lt_opd_ray.sources.resolve import load_samples


def with_pools(job, **pools):
    updates = {name: getattr(job.pools, name).model_copy(update=fields) for name, fields in pools.items()}
    return job.model_copy(update={"pools": job.pools.model_copy(update=updates)})


def rollout_throughput(job, samples_ref, count: int, repeats: int = 3) -> float:
    """Best of `repeats` batches (tokens/s), after one warm-up batch."""
    pool = RolloutPool(job)
    groups = lambda update: pool.submit(samples_ref, 2500, update, [(0, count)], -(-count // len(pool.workers)))  # noqa: E731
    ray.get([g.summary for g in groups(0)])  # warm-up
    rates = []
    for step in range(1, repeats + 1):
        begin = time.perf_counter()
        tokens = sum(s.tokens for s in ray.get([g.summary for g in groups(step)]))
        rates.append(tokens / (time.perf_counter() - begin))
    pool.shutdown()
    return max(rates)


def teacher_throughput(job, samples_ref, shard_refs, tokens: int, rounds: int, repeats: int = 3) -> float:
    """Best of `repeats` bursts of `rounds` rounds (positions/s), after a warm-up request."""
    service = TeacherService(job)
    service.wait_ready()
    ray.get(service.async_score(samples_ref, shard_refs[:1]))  # warm-up
    rates = []
    for _ in range(repeats):
        begin = time.perf_counter()
        ray.get([ref for _ in range(rounds) for ref in service.async_score(samples_ref, shard_refs)])
        rates.append(tokens * rounds / (time.perf_counter() - begin))
    service.shutdown()
    return max(rates)


def autoscaling_trace(job, samples_ref, shard_refs, burst: int) -> list[tuple[float, int, str]]:
    """(seconds, running replicas, phase) sampled every second during a burst and after it."""
    import threading

    service = TeacherService(job)
    service.wait_ready()
    trace, phase, stop = [], ["burst"], threading.Event()
    begin = time.perf_counter()

    def poll():
        while not stop.is_set():
            trace.append((time.perf_counter() - begin, service.replicas(), phase[0]))
            time.sleep(1.0)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    ray.get([ref for _ in range(burst) for ref in service.async_score(samples_ref, shard_refs)])
    phase[0] = "idle"
    deadline = time.perf_counter() + job.pools.teacher.downscale_delay_s + 60
    while time.perf_counter() < deadline and not (trace and trace[-1][2] == "idle" and trace[-1][1] == job.pools.teacher.min_replicas):
        time.sleep(1.0)
    stop.set()
    poller.join()
    service.shutdown()
    return trace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default="jobs/train_tiny.yaml")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--autoscaling-only", action="store_true")
    args = parser.parse_args()
    job = load_job(args.job)
    job = job.model_copy(update={"sampling": job.sampling.model_copy(update={"max_new_tokens": 24, "stop": []})})
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV})
    samples_ref = ray.put(load_samples(job.data.path, job.data.image_root, job.seed)[: args.prompts])

    rollout, teacher = {1: 1.0, 2: float("nan")}, {1: 1.0, 2: float("nan")}
    if not args.autoscaling_only:
        print(f"== rollout pool ({args.prompts} prompts x {job.sampling.n} responses x {job.sampling.max_new_tokens} tokens, best of 3)")
        rollout = {w: rollout_throughput(with_pools(job, rollout={"workers": w}), samples_ref, args.prompts) for w in (1, 2)}
        for w, rate in rollout.items():
            print(f"rollout workers {w}: {rate:8.1f} tokens/s  ({rate / rollout[1]:.2f}x)")

    pool = RolloutPool(with_pools(job, rollout={"workers": 2}))
    groups = pool.submit(samples_ref, 2500, 0, [(0, args.prompts)], args.prompts // 2)
    tokens = sum(s.tokens for s in ray.get([g.summary for g in groups]))
    shard_refs = [g for g in groups for _ in range(2)]  # 4 requests per round
    if not args.autoscaling_only:
        print(f"== teacher service ({len(shard_refs)} group requests per round, {2 * tokens} positions, 3 rounds, best of 3)")
        for r in (1, 2):
            teacher[r] = teacher_throughput(with_pools(job, teacher={"replicas": r, "min_replicas": r, "max_replicas": r}), samples_ref, shard_refs, 2 * tokens, 3)
            print(f"teacher replicas {r}: {teacher[r]:8.1f} tokens/s  ({teacher[r] / teacher[1]:.2f}x)")

    scaling = with_pools(job, teacher={"replicas": 1, "min_replicas": 1, "max_replicas": 2, "max_batch_size": 2,
                                       "target_queue_per_replica": 1.0, "upscale_delay_s": 1.0, "downscale_delay_s": 5.0})
    print("== teacher autoscaling (min 1, max 2, target 1 queued request per replica, up after 1 s, down after 5 s)")
    trace = autoscaling_trace(scaling, samples_ref, shard_refs, burst=40)
    for t, replicas, phase in trace:
        print(f"t={t:5.1f}s replicas={replicas} {phase}")
    peak = max(r for _, r, _ in trace)
    print(f"RESULT rollout 2/1 workers = {rollout[2] / rollout[1]:.2f}x; teacher 2/1 replicas = {teacher[2] / teacher[1]:.2f}x;"
          f" autoscaling peak {peak} replicas (bounds 1..2), back to {trace[-1][1]} after the burst")
    pool.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
