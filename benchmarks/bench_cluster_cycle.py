"""Cluster cycle benchmark: what one local Ray cluster and one Serve controller cost to start and stop.

    python benchmarks/bench_cluster_cycle.py              # 3 cycles
    python benchmarks/bench_cluster_cycle.py --cycles 5

A test module that started a cluster of its own paid one cycle (and one Serve controller once its first driver
deployed the teacher); the suite's job-running modules share one (tests/conftest.py, `cluster`). Each cycle, in
this process as the tests run it: `ray.init` as the shared cluster starts (a local cluster of 8 CPUs, the workers' env, a metrics port),
`serve.start()`, `serve.shutdown()`, `ray.shutdown()`; the table gives each phase's median over the cycles.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
from ray import serve

from lt_opd_ray.runtime.launch import WORKER_ENV
from lt_opd_ray.runtime.learner_group import free_port


def one_cycle() -> dict[str, float]:
    seconds, begin = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal begin
        now = time.perf_counter()
        seconds[name], begin = now - begin, now

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV},
             _metrics_export_port=free_port())
    lap("ray.init")
    serve.start()
    lap("serve.start")
    serve.shutdown()
    lap("serve.shutdown")
    ray.shutdown()
    lap("ray.shutdown")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(WORKER_ENV)
    rows = []
    for i in range(args.cycles):
        rows.append(one_cycle())
        print(f"cycle {i}: " + ", ".join(f"{name} {s:.1f} s" for name, s in rows[-1].items()), flush=True)
    print(f"\nmedian of {len(rows)} cycles:")
    for name in rows[0]:
        print(f"  {name:<16} {statistics.median(r[name] for r in rows):6.1f} s")
    cluster = statistics.median(r["ray.init"] + r["ray.shutdown"] for r in rows)
    controller = statistics.median(r["serve.start"] + r["serve.shutdown"] for r in rows)
    print(f"  a cluster {cluster:.1f} s, a Serve controller {controller:.1f} s")


if __name__ == "__main__":
    main()
