"""The toy tasks by name: each design is one module (`board.py`, `sizes.py`, `circles.py`, `discs.py`) exposing a `ToyTask`."""

from __future__ import annotations

from lt_opd_ray.core.errors import InputError
from lt_opd_ray.sources.toy import board, circles, discs, sizes
from lt_opd_ray.sources.toy.base import ToyTask


def toy_tasks() -> dict[str, ToyTask]:
    return {task.name: task for task in (board.TASK, sizes.TASK, circles.TASK, discs.TASK)}


def toy_task(name: str) -> ToyTask:
    tasks = toy_tasks()
    if name not in tasks:
        raise InputError(f"unknown toy task {name!r}; known: {', '.join(tasks)}")
    return tasks[name]
