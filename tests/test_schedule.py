"""Streaming and bounded staleness (schedule.*) on a real local Ray cluster: DeepSpeed, Serve, tiny real Qwen3.5.

Streaming (every job: one rollout group per prompt, learners training as groups arrive) is checked against
the single-process reference in test_runtime.py; here, max_staleness 1 against the reference's lagged
schedule, its independence of the weights when nothing is learned, a worker killed while the learners
train, and an exact resume with rollouts in flight.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import ray
import torch
from conftest import job_for
from test_runtime import driver_run, reference_run, relative_distance

from lt_opd_ray.config.schema import LearningRates
from lt_opd_ray.core.wire import RolloutGroup, ScoringRequest, Span, StaleRolloutError, TeacherRun
from lt_opd_ray.runtime.driver import Driver
from lt_opd_ray.runtime.group_receiver import GroupReceiver, ScoreRequests, Substitutes


def lagged(job, staleness: int = 1, learning: bool = True, adam_eps: float | None = None):
    updates = {"schedule": job.schedule.model_copy(update={"max_staleness": staleness})}
    if adam_eps is not None:
        updates["optimizer"] = job.optimizer.model_copy(update={"eps": adam_eps})
    if not learning:
        updates["optimizer"] = job.optimizer.model_copy(update={"lr": LearningRates(language_model=0.0, vision_encoder=0.0, merger=0.0)})
    return job.model_copy(update=updates)


STEPS = 4


def lagged_job(model_dir, folder, ranks: int, name: str):
    """The lagged (max_staleness 1) job of this module's reference test and its resume test: checkpoints every 2
    updates (which leaves the training unchanged) so one run serves both."""
    # Adam's eps at 1e-5: with the default 1e-8 an entry whose gradient is fp32 rounding noise (~1e-10) still moves by
    # ~lr, so runs that round differently drift apart by ~1e-3 by update 4 (measured, on-policy too); 1e-5 keeps
    # updates proportional to gradients and the comparison tight
    return lagged(job_for(model_dir, folder, ranks=ranks, every=2, name=name, total=STEPS, prompts=3), adam_eps=1e-5)


@pytest.fixture(scope="module")
def lagged_runs(cluster, kept, tiny_dirs, tmp_path_factory):
    """ranks -> (the job, its driver's step logs and final weights), each run once for the module."""
    runs = {}

    def run(ranks: int):
        if ranks not in runs:
            job = lagged_job(tiny_dirs["qwen3_5"], tmp_path_factory.mktemp(f"lag{ranks}"), ranks, f"lag{ranks}")
            _, logs, weights = driver_run(job, STEPS, kept)
            runs[ranks] = job, logs, weights
        return runs[ranks]

    return run


@pytest.fixture(scope="module")
def lagged_references(tiny_dirs, tmp_path_factory):
    """The single-process lagged reference of `lagged_job` and its on-policy twin (ranks do not enter a reference)."""
    job = lagged_job(tiny_dirs["qwen3_5"], tmp_path_factory.mktemp("lagref"), 1, "lagref")
    return reference_run(job, STEPS), reference_run(lagged(job, 0, adam_eps=1e-5), STEPS)[0]


@pytest.mark.parametrize("ranks", [1, 2])
def test_staleness_one_reproduces_the_lagged_reference(lagged_runs, lagged_references, ranks):
    """Update t trains on rollouts of the weights after update t - 1 (the first two on the initial weights)."""
    (reports, ref_weights), on_policy = lagged_references
    _, logs, weights = lagged_runs(ranks)
    assert [log.staleness for log in logs] == [0, 1, 1, 1]
    assert [log.budget_bps for log in logs] == [r.budget_bps for r in reports]
    assert [log.tokens for log in logs] == [r.stats.tokens for r in reports]  # the same rollouts, update by update
    assert logs[0].loss == pytest.approx(reports[0].stats.loss, rel=1e-5, abs=1e-8)
    # later losses: 1e-5 relative held on an AVX2 EPYC; on an AVX-512 Xeon the CPU kernels round otherwise and update 2 of
    # the 2-rank run differs by 2.2e-5 (measured, 2026-12-02, on the code before and after this bound): still 200x below
    # the on-policy reference's difference asserted below
    for log, report in zip(logs[1:], reports[1:]):
        assert log.loss == pytest.approx(report.stats.loss, rel=5e-5)
    assert relative_distance(weights, ref_weights) <= 1e-5  # measured 4e-7
    # the lag is real: the on-policy reference samples update 1 on from other weights
    assert on_policy[0].stats.loss == reports[0].stats.loss
    assert all(a.stats.loss != pytest.approx(b.stats.loss, rel=1e-2) for a, b in zip(on_policy[1:], reports[1:]))


@pytest.fixture(scope="module")
def nothing_learned(cluster, kept, tiny_dirs, tmp_path_factory):
    """Step logs of a synchronous (max_staleness 0) run that learns nothing (every learning rate 0), one rollout
    worker: the rollouts every run of these weights samples, whatever its staleness or its workers (a rollout is
    seeded by its update, sample and response; its recorded log-probs round with the batch its worker sampled)."""
    job = job_for(tiny_dirs["qwen3_5"], tmp_path_factory.mktemp("lr0"), ranks=1, workers=1, name="lr0", total=STEPS)
    return driver_run(lagged(job, 0, learning=False), STEPS, kept)[1]


def test_with_nothing_learned_staleness_one_samples_the_same_rollouts(nothing_learned, kept, tiny_dirs, tmp_path):
    """Pipelined against synchronous: each rollout is seeded by its update, sample and response, never by the moment
    it runs."""
    job = job_for(tiny_dirs["qwen3_5"], tmp_path, ranks=1, workers=1, name="lr0-pipelined", total=STEPS)
    _, pipelined, _ = driver_run(lagged(job, 1, learning=False), STEPS, kept)
    assert [log.staleness for log in pipelined] == [0, 1, 1, 1]
    assert [log.tokens for log in pipelined] == [log.tokens for log in nothing_learned]
    assert [log.loss for log in pipelined] == [log.loss for log in nothing_learned]  # same rollouts, same weights: bit for bit


class KillsAWorker(Driver):
    """SIGKILLs rollout-1 as soon as update 2's groups are queued on it, i.e. while the learners train on update 1."""

    victim: int | None = None

    def submit(self, update: int):
        flight = super().submit(update)
        if update == 2 and self.victim is not None:
            os.kill(self.victim, signal.SIGKILL)
        return flight


def test_a_worker_killed_while_the_learners_train_loses_and_repeats_no_sample(nothing_learned, kept, tiny_dirs, tmp_path):
    steps, expected = STEPS, nothing_learned
    job = lagged(job_for(tiny_dirs["qwen3_5"], tmp_path, ranks=1, workers=2, name="kill", total=steps), learning=False)
    driver = KillsAWorker(job, roles=kept)
    try:
        driver.victim = ray.get(driver.rollouts.workers[1].pid.remote())
        logs = [driver.run_step() for _ in range(steps)]
        assert driver.metrics.restart_counts == {"rollout": 1}
        assert ray.get(driver.rollouts.workers[1].pid.remote()) != driver.victim
    finally:
        driver.shutdown()
    assert driver.cursor == steps * job.sampling.prompts_per_step
    assert [log.sequences for log in logs] == [job.sampling.prompts_per_step * job.sampling.n] * steps
    # the lost group was sampled again, by the weights after update 1: with nothing learned, the same rollouts (two
    # workers' batches round the sampler's log-probs otherwise than one worker's: 2e-7 relative measured)
    assert [log.tokens for log in logs] == [log.tokens for log in expected]
    assert [log.loss for log in logs] == pytest.approx([log.loss for log in expected], rel=1e-6)
    assert [log.staleness for log in logs] == [0, 1, 1, 1]  # update 2's resampled group is fresher, its other is not


def test_resume_with_rollouts_in_flight_continues_exactly(lagged_runs, kept, tmp_path):
    """The lagged run cut after its step-2 checkpoint (its folder as a run stopped there leaves it) and resumed
    continues as the run went on."""
    job, straight_logs, straight_weights = lagged_runs(1)
    cut = tmp_path / "cut"
    shutil.copytree(Path(job.checkpoint.dir) / "step-2", cut / "step-2")
    (cut / "latest").write_text("step-2")
    assert (cut / "step-2" / "in_flight.pt").exists()  # update 2's rollouts, sampled by v1 while update 1 trained
    job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"dir": str(cut)})})
    first, resumed_logs, resumed_weights = driver_run(job, STEPS, kept, resume=True)
    assert first == 2
    assert [log.staleness for log in resumed_logs] == [1, 1]  # update 2 trained on the kept v1 rollouts, not fresh ones
    assert [round(log.loss, 12) for log in resumed_logs] == [round(log.loss, 12) for log in straight_logs[2:]]
    for name, value in straight_weights.items():
        assert torch.equal(resumed_weights[name], value), name


# ------------------------------------------------------------------ the learner's checks, without Ray
def group(update: int, version: int | None, rank: int = 0) -> RolloutGroup:
    return RolloutGroup(update, 4, 6, rank, [], "rollout-3", version, Span("rollout", "rollout-3", "", 0.0, 1.0))


@pytest.mark.parametrize("staleness, version, message", [
    (0, 6, "sampled by weights v6; learner-0 is at v7 and schedule.max_staleness is 0"),
    (1, 5, "sampled by weights v5; learner-0 is at v7 and schedule.max_staleness is 1"),
    (1, 8, "sampled by weights v8; learner-0 is at v7"),  # from the future: a broken version count
    (1, None, "sampled while its worker's weights were half written"),
])
def test_the_learner_refuses_rollouts_staler_than_the_bound(tiny_dirs, tmp_path, staleness, version, message):
    job = lagged(job_for(tiny_dirs["qwen3_5"], tmp_path), staleness)
    receiver = GroupReceiver([], version=7, job=job, rank=0, vocab_size=100, scoring=ScoringRequest("teacher-app", samples_ref=None, run=TeacherRun(0, job_ref=None)),
                             substitutes=Substitutes(), requests=ScoreRequests(send=None))
    with pytest.raises(StaleRolloutError, match=f"rollout group of prompts 4-5 from rollout-3 was {message}"):
        receiver.check(group(7, version))
    receiver.check(group(7, 7 - staleness))
    assert receiver.staleness == staleness
    with pytest.raises(ValueError, match="learner-0 at update 7 was sent the rollout group of prompts 4-5 from rollout-3 for update 6, rank 0"):
        receiver.check(group(6, 6))


def test_closed_score_requests_drop_what_is_unsent_and_end_their_thread():
    """A learner rank kept for another run (runtime/kept_roles.py) closes its run's requests: the one being sent
    finishes, those not yet sent are dropped, answers not taken are let go, and the sender thread ends."""
    import threading

    sending, release, sent = threading.Event(), threading.Event(), []

    def send(scoring, group_ref, update, start, stop):
        sending.set()
        release.wait(timeout=10)
        sent.append(group_ref)
        return f"payload of {group_ref}"

    requests = ScoreRequests(send)
    requests.ask(None, "group-a", 0, 0, 2)
    assert sending.wait(timeout=10)  # the sender is inside group-a's request
    requests.ask(None, "group-b", 0, 2, 4)
    requests.close()
    release.set()
    requests.sender.join(timeout=10)
    assert not requests.sender.is_alive() and sent == ["group-a"]  # group-b was never sent


def test_busy_fractions_count_each_span_in_the_windows_it_overlaps():
    from dataclasses import asdict

    from lt_opd_ray.tools.timeline import window_busy

    def step(index, period, spans):
        return {"step": index, "phases": {"step": period}, "timeline": [asdict(Span(*s)) for s in spans]}

    # update 0: window [0, 10]; update 1: window [10, 14]. Update 1's rollouts ran in update 0's window (staleness 1).
    steps = [
        step(0, 10.0, [("rollout", "w0", "u0", 0, 4), ("teacher", "t", "u0", 2, 5), ("learner", "l0", "u0", 5, 10), ("learner", "l1", "u0", 5, 9)]),
        step(1, 4.0, [("rollout", "w0", "u1", 5, 9), ("teacher", "t", "u1", 8, 11), ("learner", "l0", "u1", 10, 14), ("learner", "l1", "u1", 10, 12)]),
    ]
    first, second = window_busy(steps)
    assert first == pytest.approx({"rollout": 8 / 10, "teacher": 5 / 10, "learner": 9 / 20})  # the teacher's 8-11 span: 2 s here
    assert second == pytest.approx({"rollout": 0.0, "teacher": 1 / 4, "learner": 6 / 8})


def test_an_actors_overlapping_spans_count_once_in_its_busy_time():
    """Groups sampled in one batch, or sharing a vLLM engine, overlap on one actor: busy is their union, per actor,
    against a brute-force count on a 1 ms grid."""
    import random

    from lt_opd_ray.core.wire import busy_seconds

    rng = random.Random(0)
    spans = [Span("rollout", f"w{rng.randrange(3)}", "g", a, a + rng.uniform(0, 3)) for a in (rng.uniform(0, 10) for _ in range(40))]
    for start, end in [(float("-inf"), float("inf")), (2.0, 7.5)]:
        grid = [t / 1000 for t in range(-1000, 14000)]
        brute = sum(0.001 for actor in {s.actor for s in spans} for t in grid
                    if start <= t < end and any(s.actor == actor and s.start <= t < s.end for s in spans))
        assert busy_seconds(spans, start, end) == pytest.approx(brute, abs=0.01 * len(spans))
    same_batch = [Span("rollout", "w0", f"p{i}", 1.0, 3.0) for i in range(4)]
    assert busy_seconds(same_batch) == pytest.approx(2.0)  # not 8
