"""Start-up benchmark: how long the tiny job's driver takes to start its pools and to stop them.

    python benchmarks/bench_start.py              # 4 starts of jobs/train_tiny.yaml on a local Ray cluster
    python benchmarks/bench_start.py --starts 8

Every run of the system, and most runtime tests, pay this: the rollout worker, the Serve teacher replica and the
two DeepSpeed learner ranks start together (each a new process importing torch and transformers and loading its
model), then the first weight sync. The first start also starts Ray's and Serve's own processes and is reported
apart; the table gives, per later start, the seconds until each pool was ready, the whole start, one update and
the stop (the teacher app deleted, every actor killed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import ray

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.runtime.driver import Driver
from lt_opd_ray.runtime.launch import WORKER_ENV


def one_start(job) -> dict[str, float]:
    begin = time.perf_counter()
    driver = Driver(job)
    started = time.perf_counter()
    try:
        driver.run_step()
        stepped = time.perf_counter()
    finally:
        driver.shutdown()
    stopped = time.perf_counter()
    return {**{f"{pool} ready": seconds for pool, seconds in driver.pools_ready.items()},
            "start": started - begin, "one update": stepped - started, "stop": stopped - stepped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="jobs/train_tiny.yaml")
    parser.add_argument("--starts", type=int, default=4)
    args = parser.parse_args()
    os.environ.update(WORKER_ENV)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV})
    try:
        rows = []
        with tempfile.TemporaryDirectory() as folder:
            for i in range(args.starts):
                job = load_job(args.job)
                job = job.model_copy(update={"name": f"start-{i}", "checkpoint": job.checkpoint.model_copy(update={"dir": f"{folder}/{i}"})})
                rows.append(one_start(job))
                print(f"start {i}: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in rows[-1].items()), flush=True)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    later = rows[1:] or rows
    print(f"\nmedian of starts 1-{len(rows) - 1} (start 0 also starts Ray's and Serve's processes):")
    for name in rows[0]:
        print(f"  {name:<34} {statistics.median(r[name] for r in later):6.1f} s")


if __name__ == "__main__":
    main()
