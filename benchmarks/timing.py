"""The benchmarks' shared timer: the best of several runs after a warm-up."""

from __future__ import annotations

import time


def best_of(repeats: int, run) -> tuple[float, object]:
    """(fastest seconds of `repeats` calls of `run` after one warm-up call, the last call's result)."""
    run()
    times, result = [], None
    for _ in range(repeats):
        begin = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - begin)
    return min(times), result
