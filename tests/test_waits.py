"""The watched wait on real Ray actors: an actor that answers its ping but stays inside one working step (a hung
kernel: its working thread blocked in native code with the GIL released, as `time.sleep` is) is named with the step;
one that waits on others, or moves through short steps for longer than the bound, is not."""

from __future__ import annotations

import time

import pytest
import ray

import lt_opd_ray.runtime.waits as waits
from lt_opd_ray.runtime.waits import NoAnswerError, ProgressMark, Watched, wait_watched

LIVENESS_S = 2.0


@ray.remote(num_cpus=1, concurrency_groups={"control": 1})
class Stepper:
    def __init__(self):
        self.progress = ProgressMark()

    def work(self, steps: int, seconds_each: float, hang_at: int | None = None, working: bool = True) -> int:
        for i in range(steps):
            self.progress.mark(f"step {i}", working=working)
            time.sleep(3600 if i == hang_at else seconds_each)
        return steps

    @ray.method(concurrency_group="control")
    def ping(self):
        return self.progress.read()


def watched_run(calls: dict[str, tuple], timeout_s: float = 60.0) -> float:
    """Start `work(*args)` on one Stepper per name and wait for all, watched; returns the seconds the wait took. The
    actors' start is not timed: the bound is for answers, not for a process start, which a loaded machine can take
    seconds over."""
    actors = {name: Stepper.remote() for name in calls}
    ray.get([actor.ping.remote() for actor in actors.values()])
    refs = [actors[name].work.remote(*args) for name, args in calls.items()]
    watched = [Watched(name, actor.ping.remote, lambda: "working") for name, actor in actors.items()]
    begin = time.monotonic()
    try:
        wait_watched(refs, list(calls), timeout_s, "the steps", watched, LIVENESS_S)
        return time.monotonic() - begin
    finally:
        for actor in actors.values():
            ray.kill(actor)


def test_an_actor_stuck_inside_a_working_step_is_named_with_the_step_not_its_waiting_peer(cluster, monkeypatch):
    monkeypatch.setattr(waits, "LIVENESS_TICK_S", 0.25)
    with pytest.raises(NoAnswerError) as info:  # the wait's own bound (600 s) would raise another message, much later
        watched_run({"rank-0": (1, 3600.0, None, False), "rank-1": (5, 0.1, 2)}, timeout_s=600.0)  # rank-0 waits on rank-1 the whole time
    assert str(info.value).startswith("rank-1 (step 2) answered but made no progress for over 2 s while the steps"), info.value


def test_short_steps_for_longer_than_the_bound_are_progress(cluster, monkeypatch):
    monkeypatch.setattr(waits, "LIVENESS_TICK_S", 0.25)
    assert watched_run({"rank-0": (12, 0.5), "rank-1": (12, 0.5)}) > 2 * LIVENESS_S


@ray.remote(num_cpus=0)
class Evaluator:
    def evaluate(self):
        raise ValueError("samples without a reference answer cannot be scored: a, b")


def test_an_error_raised_inside_an_actor_is_told_as_its_own_line_not_rays_wrapper(cluster, tmp_path):
    """`lt-opd train`'s one line for an unforeseen error: the actor's exception and method, without the remote
    traceback and colour codes Ray's wrapper carries; `--resume` offered only where a checkpoint exists."""
    from conftest import job_for

    from lt_opd_ray.cli.jobs import _resume_hint
    from lt_opd_ray.runtime.waits import in_words

    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(Evaluator.remote().evaluate.remote())
    assert "\x1b[" in str(info.value)  # what was printed before
    assert in_words(info.value) == "ValueError in Evaluator.evaluate: samples without a reference answer cannot be scored: a, b"
    assert in_words(KeyError("x")) == "KeyError: 'x'"
    job = job_for("tiny:qwen3_5", tmp_path / "run")
    assert _resume_hint(job) == "no checkpoint was written, so a new run starts from the beginning"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("step-4")
    assert _resume_hint(job) == "`--resume` continues from step-4"
