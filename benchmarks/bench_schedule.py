"""Seconds per update of one job under three schedules, in one run, with the pools' busy fractions;
then the planner's estimates for the main job on 8 GPUs next to the paper's 311 s/update.

    python benchmarks/bench_schedule.py                      # the tiny job, 6 updates per schedule (~3 min)
    python benchmarks/bench_schedule.py --job jobs/train_qwen35_shape.yaml --updates 2   # paper-shaped (~20 min)

Schedules: "whole shares" (one rollout group per learner rank, max_staleness 0: a rank's
teacher scoring and training wait for its whole share, the synchronous schedule of
earlier versions), "streaming" (one group per prompt, max_staleness 0) and
"staleness 1" (one group per prompt, the next update sampled while the learners train).
On a CPU box every pool shares the same cores, so overlap buys less than on GPUs,
where each pool has its own; the planner's figures are estimates, not measurements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict

import ray

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.tools.timeline import window_busy


def with_schedule(job, name: str):
    per_rank = -(-job.sampling.prompts_per_step // job.pools.learner.ranks)
    schedule = {"whole shares": {"group_prompts": per_rank, "max_staleness": 0},
                "streaming": {"group_prompts": 1, "max_staleness": 0},
                "staleness 1": {"group_prompts": 1, "max_staleness": 1}}[name]
    checkpoint = job.checkpoint.model_copy(update={"dir": f"runs/bench-schedule/{name.replace(' ', '-')}", "every_steps": 10**6})
    return job.model_copy(update={"schedule": job.schedule.model_copy(update=schedule), "checkpoint": checkpoint})


def measure(job, updates: int) -> list:
    from lt_opd_ray.runtime.driver import Driver
    from lt_opd_ray.runtime.launch import init_ray

    init_ray(job)
    driver = Driver(job)
    try:
        return [driver.run_step() for _ in range(updates)]
    finally:
        driver.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="jobs/train_tiny.yaml")
    parser.add_argument("--updates", type=int, default=6, help="updates per schedule (the first and last are left out of the means when > 3)")
    parser.add_argument("--no-plan", action="store_true")
    args = parser.parse_args()
    job = load_job(args.job)
    if args.updates > job.budget.total_steps:  # a longer run of the same shapes (the curriculum holds its last budget)
        job = job.model_copy(update={"budget": job.budget.model_copy(update={"total_steps": args.updates})})
    results = {}
    schedules = ["whole shares", "streaming", "staleness 1"]
    if -(-job.sampling.prompts_per_step // job.pools.learner.ranks) == 1:
        print("one prompt per learner rank: whole shares are single prompts, the streaming schedule; measured once, as streaming")
        schedules.remove("whole shares")
    for name in schedules:
        logs = measure(with_schedule(job, name), args.updates)
        busy = window_busy([json.loads(json.dumps(asdict(log))) for log in logs])
        counted = slice(1, -1) if len(logs) > 3 else slice(None)  # steady state: without the fill and the drain
        results[name] = (statistics.mean(log.phases.step for log in logs[counted]),
                         {pool: statistics.mean(b[pool] for b in busy[counted]) for pool in ("rollout", "teacher", "learner")},
                         [round(log.phases.step, 2) for log in logs])
    pools = job.pools
    print(f"== {args.job}: {job.sampling.prompts_per_step} prompts x {job.sampling.n} responses (up to {job.sampling.max_new_tokens} tokens),"
          f" {pools.rollout.workers} rollout worker(s), {pools.teacher.replicas} teacher replica(s), {pools.learner.ranks} learner ranks;"
          f" {args.updates} updates each, mean over {'all but the first and last (fill, drain)' if args.updates > 3 else 'all'}")
    print(f"{'schedule':<14} {'s/update':>9} {'vs first':>9} {'rollout busy':>13} {'teacher busy':>13} {'learner busy':>13}  per update")
    base = results[schedules[0]][0]
    for name, (seconds, busy, each) in results.items():
        print(f"{name:<14} {seconds:>8.2f}s {base / seconds:>8.2f}x " + " ".join(f"{busy[p]:>13.2f}" for p in busy) + f"  {each}")
    print("RESULT " + ", ".join(f"{name} {seconds:.2f} s/update ({base / seconds:.2f}x)" for name, (seconds, _, _) in results.items()))
    if not args.no_plan:
        for gpu in ("a100", "h200"):
            print(f"== planner (ESTIMATE): jobs/train_qwen35.yaml on 8x {gpu}")
            out = subprocess.run([sys.executable, "-m", "lt_opd_ray.cli.main", "plan", "jobs/train_qwen35.yaml", "--gpus", "8", "--gpu", gpu,
                                  "--preset", "qwen3.5-4b"], capture_output=True, text=True, check=True)
            print(out.stdout.rstrip())


if __name__ == "__main__":
    main()
