"""Faults injected into real runs (local Ray cluster, real DeepSpeed and Serve, tiny Qwen3.5): each ends in a
completed or resumed run whose weights equal an uninterrupted run's, or in one named error, and leaves nothing
running. (A rollout worker killed between updates: tests/test_runtime.py; a SIGKILLed driver resumed by `lt-opd train
--resume`: tests/test_main_job.py.)"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import ray
import torch
from conftest import job_for, wait_until
from held_weights import assert_engines_hold
from ray import serve

from lt_opd_ray.runtime.driver import Driver
from lt_opd_ray.runtime.learner_group import LearnerGroup
from lt_opd_ray.runtime.teacher import TeacherService
from lt_opd_ray.runtime.waits import NoAnswerError, RoleDiedError

STEPS = 4  # budget.decay_end of job_for


def fault_job(model_dir, folder, name, **overrides):
    """Two rollout workers (one can be done without inside an update), two ZeRO-2 learner ranks."""
    return job_for(model_dir, folder, ranks=2, zero_stage=2, every=1, total=STEPS, name=name, **{"workers": 2, **overrides})


def run_to_end(driver, after: dict | None = None):
    """The learners' weights at the end; with `after`, also after each update (by step)."""
    try:
        while driver.step < STEPS:
            driver.run_step()
            if after is not None:
                after[driver.step] = driver.learners.full_state_dict()
        return driver.learners.full_state_dict()
    finally:
        driver.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(cluster, kept, tiny_dirs, tmp_path_factory):
    """An uninterrupted run's weights after each update, by step."""
    after = {}
    run_to_end(Driver(fault_job(tiny_dirs["qwen3_5"], tmp_path_factory.mktemp("straight"), "straight"), roles=kept), after)
    return after


def assert_same_weights(got, expected):
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def all_released() -> bool:
    """Every CPU the runs' actors reserved is free again (Serve's controller reserves none)."""
    return ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]


def test_a_teacher_replica_killed_mid_update_is_asked_again_and_the_run_matches(uninterrupted, kept, tiny_dirs, tmp_path, capsys):
    driver = Driver(fault_job(tiny_dirs["qwen3_5"], tmp_path, "teacher-kill"), roles=kept)
    try:
        driver.run_step()
        pid = driver.teacher.handle.pid.remote().result(timeout_s=60)
        workers = [ray.get(w.pid.remote()) for w in driver.rollouts.workers]
        for worker in workers:
            os.kill(worker, signal.SIGSTOP)  # update 1's groups stay unsampled ...
        driver.next = driver.submit(1)
        # ... while the learner ranks send their scoring requests and the replica holds them, waiting for the groups
        assert wait_until(lambda: driver.teacher.handle.holding.remote().result(timeout_s=60) == 2)
        os.kill(pid, signal.SIGKILL)  # then it dies
        for worker in workers:
            os.kill(worker, signal.SIGCONT)
        log = driver.run_step()
        assert log.step == 1 and driver.metrics.restart_counts.get("teacher", 0) >= 1
        assert re.search(r"teacher: \d+ scoring request\(s\) of learner-\d in update 1 sent again: the replica serving them died", capsys.readouterr().out)
    except BaseException:
        driver.shutdown()  # a failed check leaves nothing holding the cluster's CPUs for the next test
        raise
    assert_same_weights(run_to_end(driver), uninterrupted[STEPS])


def test_a_learner_rank_killed_mid_run_stops_with_one_named_error_and_resume_matches(uninterrupted, kept, tiny_dirs, tmp_path):
    kept.close()  # the run starts its own pools: its stop must free every CPU
    job = fault_job(tiny_dirs["qwen3_5"], tmp_path, "learner-kill")
    driver = Driver(job)
    driver.run_step()  # checkpoint step-1
    os.kill(ray.get(driver.learners.actors[1].pid.remote()), signal.SIGKILL)
    with pytest.raises(RoleDiedError, match="learner-1 died while"):
        driver.run_step()
    driver.shutdown()  # copes with the dead rank: every pool is stopped
    assert wait_until(all_released), ray.available_resources()
    assert not serve.status().applications
    resumed = Driver(job, resume=True)
    assert resumed.step == 1
    assert_same_weights(run_to_end(resumed), uninterrupted[STEPS])


def test_a_frozen_learner_rank_is_named_not_the_rank_waiting_on_it(cluster, tiny_dirs, tmp_path):
    """`kill -STOP`: the process lives but answers nothing; the other rank waits on it in a collective. The error
    names the frozen rank within the liveness bound. (A teacher replica: bench_stuck.py.)"""
    # the liveness bound (8 s) far inside the wait bound (600 s): the error below can only come from the liveness ping
    driver = Driver(fault_job(tiny_dirs["qwen3_5"], tmp_path, "freeze-learner", workers=1,
                              extra="schedule: {liveness_timeout_s: 8, wait_timeout_s: 600}"))
    try:
        driver.run_step()
        pid = ray.get(driver.learners.actors[1].pid.remote())
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(NoAnswerError) as info:
                driver.run_step()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert str(info.value).startswith("learner-1 stopped answering while learner step of update 1; last answer "), info.value
    finally:
        driver.shutdown()


def test_rollout_workers_lost_inside_an_update_are_done_without_then_replaced_and_the_run_matches(uninterrupted, kept, tiny_dirs, tmp_path, capsys,
                                                                                                  monkeypatch):
    """On-policy, while the learners wait on update 1's groups: rollout-1 freezes (after the liveness bound it is
    stopped and rollout-0 samples its group: the same rollouts, seeded by update, sample and response), then rollout-0
    dies with it (no worker lives: both are replaced, given the learners' weights by learner-0 while the step waits,
    and sample it), then rollout-0's replacement dies in turn (rollout-1 samples it). The update's weights equal an
    uninterrupted run's: nothing lost, nothing trained twice. In update 2 every worker, and every replacement, dies:
    after REPLACE_ATTEMPTS replacements inside the update (1 here, for time), one line naming the worker."""
    import lt_opd_ray.runtime.driver as driver_module

    driver = Driver(fault_job(tiny_dirs["qwen3_5"], tmp_path, "rollout-loss", extra="schedule: {liveness_timeout_s: 8}"), roles=kept)
    sample_again, victims, every_time = driver.sample_again, [], []

    def then_kill(flight, lost, by):  # the fault: right after groups are handed on, workers die
        again = sample_again(flight, lost, by)
        for index in victims.pop(0) if victims else every_time:
            try:
                os.kill(ray.get(driver.rollouts.workers[index].pid.remote()), signal.SIGKILL)
            except ray.exceptions.RayActorError:
                pass  # dead already
        return again

    driver.sample_again = then_kill
    try:
        driver.run_step()
        frozen = ray.get(driver.rollouts.workers[1].pid.remote())
        victims += [[0], [0]]  # rollout-0 after it took rollout-1's group; its replacement after it got the group again
        os.kill(frozen, signal.SIGSTOP)
        log = driver.run_step()
        out = capsys.readouterr().out
        assert log.step == 1 and driver.metrics.restart_counts.get("rollout") == 3, driver.metrics.restart_counts
        assert re.search(r"rollout-1 lost inside update 1 \(silent for \d+ s while sampling prompts 1-1 of update 1\): prompts 1-1 sampled"
                         r" again by rollout-0", out), out
        assert ("rollout-0, rollout-1 lost inside update 1 with no other worker (rollout-0 died while sampling prompts 1-1 of update 1):"
                " replaced, given weights v1 by learner-0") in out, out
        assert "rollout-0 lost inside update 1 (died while sampling prompts 1-1 of update 1): prompts 1-1 sampled again by rollout-1" in out, out
        assert "rollout-0 replaced by a new worker (stopped inside update 1); the next broadcast gives it the weights" in out, out
        assert_same_weights(driver.learners.full_state_dict(), uninterrupted[2])
        assert_engines_hold(driver, driver.learners.full_state_dict(), 2)

        monkeypatch.setattr(driver_module, "REPLACE_ATTEMPTS", 1)
        every_time += [0, 1]
        for worker in driver.rollouts.workers:
            os.kill(ray.get(worker.pid.remote()), signal.SIGKILL)
        with pytest.raises(RoleDiedError, match="rollout-[01] was lost 2 times inside update 2, each replacement in turn"):
            driver.run_step()
    finally:
        driver.shutdown()


def test_a_pool_that_fails_to_start_leaves_nothing_running(cluster, tiny_dirs, tmp_path, monkeypatch):
    def learners_that_fail(self):
        raise NoAnswerError("learner setup: no answer after 1800 s from learner-1")  # injected: the last pool to be ready

    monkeypatch.setattr(LearnerGroup, "wait_ready", learners_that_fail)
    with pytest.raises(NoAnswerError, match="learner-1"):
        Driver(fault_job(tiny_dirs["qwen3_5"], tmp_path, "half-started"))  # the rollout workers and the teacher were up, the learners started
    assert wait_until(all_released), ray.available_resources()
    assert not serve.status().applications


def test_the_teacher_app_a_killed_driver_left_is_removed_by_the_next_run_of_the_job(cluster, tiny_dirs, tmp_path):
    job = fault_job(tiny_dirs["qwen3_5"], tmp_path, "orphan")
    TeacherService(job).wait_ready()  # what a SIGKILLed driver leaves behind: the app, still RUNNING
    assert "orphan-teacher" in serve.status().applications
    with pytest.warns(UserWarning, match="removing the Serve app 'orphan-teacher' an earlier driver of job 'orphan' left running"):
        driver = Driver(job)
    driver.run_step()
    driver.shutdown()
    assert wait_until(lambda: not serve.status().applications)


def test_a_rollout_worker_killed_mid_broadcast_is_replaced_and_synced_and_the_learners_live_on(cluster, tmp_path):
    """The worker is frozen before a broadcast (so the stream is under way and waits on it: the 126 MB of the
    real-vocabulary model fill the socket buffers) and killed in the middle. The other worker and learner rank 0 are
    freed by an abort, the worker replaced, the group re-formed, the weights sent again; under ZeRO-3 the learners
    stayed in step and go on training."""
    import threading

    from lt_opd_ray.sources.resolve import resolve_model_dir

    job = job_for(resolve_model_dir("tiny:qwen3_5-vocab248320"), tmp_path, ranks=2, zero_stage=3, workers=2, name="sync-kill",
                  verify_weights=True)
    driver = Driver(job)
    try:
        driver.run_step()
        learner_pids = [ray.get(a.pid.remote()) for a in driver.learners.actors]
        victim = ray.get(driver.rollouts.workers[1].pid.remote())
        os.kill(victim, signal.SIGSTOP)
        result = {}
        sync = threading.Thread(target=lambda: result.update(sync=driver.broadcast(version=driver.step)))
        sync.start()
        broadcasting = lambda: ray.get(driver.learners.actors[0].alive.remote()).doing == f"v{driver.step} weight broadcast"  # noqa: E731
        assert wait_until(broadcasting), ray.get(driver.learners.actors[0].alive.remote())
        assert sync.is_alive()  # under way, and it cannot end while a receiver is frozen
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        sync.join(timeout=180)
        assert not sync.is_alive() and result["sync"].version == driver.step
        print(f"\nworker killed mid-broadcast: recovered (replaced, re-formed, synced) {time.time() - killed:.1f} s after the kill")
        assert driver.sync.replaced == ["rollout-1"] and driver.metrics.restart_counts.get("rollout") == 1
        assert ray.get(driver.rollouts.workers[1].pid.remote()) != victim
        assert [ray.get(a.pid.remote()) for a in driver.learners.actors] == learner_pids  # no learner was lost
        assert_engines_hold(driver, driver.learners.full_state_dict(), driver.step)
        log = driver.run_step()  # the learners' own group is in step: ZeRO-3 trains on
        assert log.step == 1 and log.tokens > 0
    finally:
        driver.shutdown()
