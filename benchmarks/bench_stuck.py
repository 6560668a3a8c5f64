"""Stuck, not dead: seconds from freezing each kind of actor (`kill -STOP`) to the run's message naming it, and to
the run completing where the actor is replaced.

    python benchmarks/bench_stuck.py                      # the tiny job, schedule.liveness_timeout_s 10 (~5 min on 2 cores)
    python benchmarks/bench_stuck.py --liveness 30

Each case starts the tiny job (jobs/train_tiny.yaml) through the driver on a local Ray cluster, runs one update,
freezes one actor and runs the next update:
- the job's lone rollout worker is stopped and replaced inside the update (learner rank 0 sends the replacement the
  weights while the step waits) and the update completes;
- a learner rank cannot be replaced inside an update: the update ends in a NoAnswerError naming the frozen rank and
  what it was doing (the run then stops with the checkpoint `--resume` continues from);
- a teacher replica is replaced by Serve (its health check is the liveness bound) and the update completes.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import ray

from lt_opd_ray.config.loading import load_job


def freeze_case(actor_kind: str, liveness_s: float) -> tuple[float, str]:
    """(seconds from the freeze to the outcome, the outcome's first line)."""
    from lt_opd_ray.runtime.driver import Driver
    from lt_opd_ray.runtime.launch import init_ray
    from lt_opd_ray.runtime.waits import NoAnswerError, RoleDiedError

    job = load_job("jobs/train_tiny.yaml", [f"schedule.liveness_timeout_s={liveness_s}", f"checkpoint.dir=runs/bench-stuck-{actor_kind}",
                                            "checkpoint.every_steps=1000000"])
    init_ray(job)
    driver = Driver(job)
    pid = None
    try:
        driver.run_step()
        if actor_kind == "rollout worker":
            pid = ray.get(driver.rollouts.workers[0].pid.remote())
        elif actor_kind == "learner rank":
            pid = ray.get(driver.learners.actors[1].pid.remote())
        else:
            pid = driver.teacher.handle.pid.remote().result(timeout_s=60)
        os.kill(pid, signal.SIGSTOP)
        begin = time.monotonic()
        try:
            log = driver.run_step()
            restarts = ", ".join(f"{role} {n}" for role, n in sorted(driver.metrics.restart_counts.items())) or "none"
            outcome = f"update {log.step + 1} completed (restarts: {restarts})"
        except (NoAnswerError, RoleDiedError) as exc:
            outcome = str(exc).splitlines()[0]
        return time.monotonic() - begin, outcome
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        driver.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--liveness", type=float, default=10.0, help="schedule.liveness_timeout_s (default 10)")
    args = parser.parse_args()
    rows = [(kind, *freeze_case(kind, args.liveness)) for kind in ("rollout worker", "learner rank", "teacher replica")]
    print(f"\nfrozen actor -> outcome, tiny job, schedule.liveness_timeout_s {args.liveness:g} (pings every 5 s)")
    print(f"{'frozen':<16} {'seconds':>8}  outcome")
    for kind, seconds, outcome in rows:
        print(f"{kind:<16} {seconds:>8.1f}  {outcome}")


if __name__ == "__main__":
    main()
