"""Start-up benchmark: how long the tiny job's driver takes to start its pools and to stop them.

    python benchmarks/bench_start.py              # 4 starts of jobs/train_tiny.yaml on a local Ray cluster
    python benchmarks/bench_start.py --starts 8
    python benchmarks/bench_start.py --kept       # then as many on kept pools (runtime/kept_roles.py), side by side

Every run of the system, and most runtime tests, pay this: the rollout worker, the Serve teacher replica and the
two DeepSpeed learner ranks start together (each a new process importing torch and transformers and loading its
model), then the first weight sync. The first start also starts Ray's and Serve's own processes and is reported
apart; the table gives, per later start, the seconds until each pool was ready, the whole start, one update and
the stop (the teacher app deleted, every actor killed; with --kept, the pools kept). With --kept the same starts follow on `KeptRoles`: each
run after the first starts in the rollout worker's, learner ranks' and teacher replica's processes the run before
left (its stop keeps them), and the table sets both side by side.
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
from lt_opd_ray.runtime.kept_roles import KeptRoles
from lt_opd_ray.runtime.launch import WORKER_ENV
from lt_opd_ray.runtime.roles import RAY_ROLES


def one_start(job, roles) -> dict[str, float]:
    begin = time.perf_counter()
    driver = Driver(job, roles=roles)
    started = time.perf_counter()
    try:
        driver.run_step()
        stepped = time.perf_counter()
    finally:
        driver.shutdown()
    stopped = time.perf_counter()
    return {**{f"{pool} ready": seconds for pool, seconds in driver.pools_ready.items()},
            "start": started - begin, "one update": stepped - started, "stop": stopped - stepped}


def starts(roles, job_path: str, count: int, folder: str, label: str) -> list[dict[str, float]]:
    rows = []
    for i in range(count):
        job = load_job(job_path)
        job = job.model_copy(update={"name": f"{label}-{i}", "checkpoint": job.checkpoint.model_copy(update={"dir": f"{folder}/{label}-{i}"})})
        rows.append(one_start(job, roles))
        print(f"{label} start {i}: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in rows[-1].items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="jobs/train_tiny.yaml")
    parser.add_argument("--starts", type=int, default=4)
    parser.add_argument("--kept", action="store_true", help="then as many starts on kept pools (runtime/kept_roles.py)")
    args = parser.parse_args()
    os.environ.update(WORKER_ENV)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV})
    kept = KeptRoles()
    try:
        with tempfile.TemporaryDirectory() as folder:
            columns = {"new pools": starts(RAY_ROLES, args.job, args.starts, folder, "new")}
            if args.kept:
                columns["kept pools"] = starts(kept, args.job, args.starts, folder, "kept")
    finally:
        from ray import serve

        kept.close()
        serve.shutdown()
        ray.shutdown()
    print(f"\nmedian of starts 1-{args.starts - 1} (start 0 also starts Ray's and Serve's processes, or the pools kept after it):")
    print("| seconds | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name in columns["new pools"][0]:
        values = [statistics.median(row[name] for row in rows[1:] or rows) for rows in columns.values()]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + " |")


if __name__ == "__main__":
    main()
