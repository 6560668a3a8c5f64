"""The driver's schedule against in-process roles (tests/fake_roles.py), in seconds: what each update trains on, for
staleness 0 and 1, with workers lost between and inside updates, a weight write refused while groups are sampled,
and checkpoints written and resumed with the next update's groups in flight.

Each run is checked against `reference_digests`, a plain loop over the schedule's contract, through digests that
change with any rollout lost, repeated or sampled by other weights. The same scenarios on a real Ray cluster (real
models, DeepSpeed, Serve) are in test_schedule.py, test_faults.py and test_checkpoints.py.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from conftest import job_for
from fake_roles import FakeRoles, Fault, reference_digests, response_tokens

import lt_opd_ray.runtime.waits as waits
from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.batch_order import batches
from lt_opd_ray.runtime.driver import Driver
from lt_opd_ray.runtime.rollout_pool import REPLACE_ATTEMPTS, deal, group_bounds
from lt_opd_ray.runtime.waits import NoAnswerError, RoleDiedError
from lt_opd_ray.weight_sync.ends import WeightUpdateRefused


@pytest.fixture(autouse=True)
def quick_liveness(monkeypatch):
    """Watched waits ping every 20 ms (5 s in a run): a lost worker is seen in the time a fake update takes."""
    monkeypatch.setattr(waits, "LIVENESS_TICK_S", 0.02)


def fake_job(tmp_path, staleness=0, ranks=2, workers=2, prompts=4, total=5, every=100, group_prompts=1, zero_stage=2,
             wait_timeout_s=20, liveness_timeout_s=1, name="fake"):
    schedule = (f"schedule: {{max_staleness: {staleness}, group_prompts: {group_prompts}, wait_timeout_s: {wait_timeout_s},"
                f" liveness_timeout_s: {liveness_timeout_s}}}")
    model = tmp_path / "fake-model"  # the fake roles load no model; the inputs' check wants a folder with a config
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return job_for(model, tmp_path / "run", ranks=ranks, workers=workers, prompts=prompts, total=total, every=every,
                   zero_stage=zero_stage, name=name, extra=schedule)


def run(job, roles: FakeRoles, steps: int, resume: bool = False) -> tuple[Driver, list]:
    driver = Driver(job, resume=resume, roles=roles)
    try:
        logs = [driver.run_step() for _ in range(steps)]
    finally:
        driver.shutdown()
    return driver, logs


def matches_reference(driver: Driver, steps: int, first: int = 0) -> None:
    digests, trained = reference_digests(driver.job, driver.samples, steps)
    for update in range(first, steps):
        assert driver.learners.trained[update] == trained[update], f"update {update}"
    assert driver.learners.digest == digests[steps]


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize(("ranks", "workers", "group_prompts", "concurrent"), [(1, 1, 1, False), (2, 2, 1, False), (2, 3, 2, True)])
def test_each_update_trains_on_what_the_schedule_says(tmp_path, staleness, ranks, workers, group_prompts, concurrent):
    """Update t: the t-th batch at budget r(t), sampled by v(t - staleness), every response once; on a transformers-like
    pool (a call per worker) and a vLLM-like one (a call per group, sampled at once)."""
    job = fake_job(tmp_path, staleness, ranks, workers, group_prompts=group_prompts)
    driver, logs = run(job, FakeRoles(concurrent=concurrent, sample_seconds=0.01 if concurrent else 0.0), 5)
    matches_reference(driver, 5)
    assert [log.staleness for log in logs] == [0] + [staleness] * 4
    assert [log.budget_bps for log in logs] == [driver.schedule.budget_bps(t) for t in range(5)]
    assert [log.sequences for log in logs] == [4 * job.sampling.n] * 5


def test_submitting_an_update_returns_while_the_teacher_admits_fewer_requests_than_it_has_groups(tmp_path):
    """A teacher with 2 request slots and an update of 8 groups: a request holds its slot until its group is sampled,
    so sending all 8 from the driver would wait for 6 groups to be sampled. `submit` returns with none sampled (the
    workers hold them here); the ranks send the other 6 as slots free, and the update trains on every group."""
    import threading
    import time

    job = fake_job(tmp_path, prompts=8)
    roles = FakeRoles(teacher_slots=2)
    roles.sampling_allowed.clear()
    driver = Driver(job, roles=roles)
    try:
        flights = []
        submitting = threading.Thread(target=lambda: flights.append(driver.submit(0)), daemon=True)
        submitting.start()
        submitting.join(timeout=30)  # a bound for a failing run only: it returns at once or never
        assert flights, "submit waited for the teacher to admit every group's request"
        assert not any(driver.sampled(g) for g in flights[0].groups) and len(flights[0].groups) == 8
        for _ in range(3000):  # the ranks' sender threads send the first two (bounded wait, 30 s)
            if roles.teacher_role.admitted == 2:
                break
            time.sleep(0.01)
        assert roles.teacher_role.admitted == 2  # and no more while nothing is sampled: the rest wait with their ranks
        roles.sampling_allowed.set()
        driver.next = flights[0]
        log = driver.run_step()
    finally:
        driver.shutdown()
    assert roles.teacher_role.admitted == 8 and log.sequences == 8 * job.sampling.n
    matches_reference(driver, 1)


def test_the_reference_tells_one_behind_from_on_policy(tmp_path):
    """The check above can fail: the two schedules train on different rollouts from update 2 on (update 1 is sampled
    by the initial weights in both: one behind it has no older weights)."""
    on_policy, _ = reference_digests(fake_job(tmp_path, 0), FakeRoles().preflight(fake_job(tmp_path, 0))[0], 5)
    lagged, _ = reference_digests(fake_job(tmp_path, 1), FakeRoles().preflight(fake_job(tmp_path, 1))[0], 5)
    assert on_policy[:3] != lagged[:3] and on_policy[:2] == lagged[:2]


def test_a_worker_lost_while_sampling_the_next_update_is_replaced_and_its_groups_sampled_again_by_the_new_weights(tmp_path):
    """Staleness 1: rollout-1 dies as it starts on update 2 (while the learners train update 1). `settle` finds its
    groups lost, the worker is replaced before the broadcast, and its groups are sampled by v2 (staleness 0 for them);
    every prompt is trained on once, n times."""
    job = fake_job(tmp_path, staleness=1)
    roles = FakeRoles([Fault(worker=1, update=2)])
    driver, logs = run(job, roles, 5)
    assert driver.rollouts.replaced == [1] and driver.metrics.restart_counts == {"rollout": 1}
    history = driver.learners.history
    dealt = {start: worker for worker, groups in deal(group_bounds(driver.learners.prompt_ranges(4), 1), 2, False) for start, _, _ in groups}
    batch = list(itertools.islice(batches(driver.samples, 4, job.data.shuffle_seed, 0), 3))[2]  # update 2's prompts
    assert sorted(uid for uid, _, _ in driver.learners.trained[2]) == sorted([s.uid for s in batch] * job.sampling.n)
    budget = driver.schedule.budget_bps(2)
    expected = sorted((s.uid, response_tokens(history[2 if dealt[i] == 1 else 1], 2, s.uid, j, budget), budget)
                      for i, s in enumerate(batch) for j in range(job.sampling.n))
    assert driver.learners.trained[2] == expected
    for update in range(5):
        assert Counter(uid for uid, _, _ in driver.learners.trained[update]) == Counter({uid: 2 for uid, _, _ in driver.learners.trained[update]})


@pytest.mark.parametrize("how", ["die", "freeze"])
def test_a_worker_lost_inside_the_update_is_done_without_and_the_run_matches(tmp_path, capsys, how):
    """Staleness 0: rollout-1 dies (or stops answering its pings) as it starts update 1's groups; the learners, waiting
    on them, watch it: its groups go to rollout-0 (the same rollouts: sampled by update, sample and response, not by
    worker) and it is replaced after the update. The run trains exactly what the uninterrupted schedule does."""
    job = fake_job(tmp_path, staleness=0)
    driver, _ = run(job, FakeRoles([Fault(worker=1, update=1, how=how)]), 5)
    matches_reference(driver, 5)
    out = capsys.readouterr().out
    why = "died" if how == "die" else r"silent for \d+ s"
    assert re.search(rf"rollout-1 lost inside update 1 \({why} while sampling prompts 2-2, 3-3 of update 1\): prompts 2-2, 3-3 sampled again by"
                     r" rollout-0; it is replaced after the update", out), out
    assert "rollout-1 replaced by a new worker (stopped inside update 1); the next broadcast gives it the weights" in out
    assert driver.rollouts.replaced == [1] and driver.metrics.restart_counts == {"rollout": 1}


def test_with_no_worker_left_inside_the_update_replacements_get_the_weights_mid_step(tmp_path, capsys):
    job = fake_job(tmp_path, workers=1)
    driver, _ = run(job, FakeRoles([Fault(worker=0, update=2)]), 4)
    matches_reference(driver, 4)
    assert "rollout-0 lost inside update 2 with no other worker (rollout-0 died while sampling prompts" in capsys.readouterr().out


def test_under_zero3_a_lost_last_worker_ends_the_update_with_its_name(tmp_path):
    """ZeRO-3 holds no whole weights on rank 0 inside a step: no replacement can be synced mid-step."""
    job = fake_job(tmp_path, workers=1, zero_stage=3)
    with pytest.raises(RoleDiedError, match=r"rollout-0 died while sampling prompts 0-0, 2-2, 1-1, 3-3 of update 1 \(learner step of update 1 waited on it\)"):
        run(job, FakeRoles([Fault(worker=0, update=1)]), 3)


def test_a_prompt_that_kills_every_worker_ends_the_run_in_one_line(tmp_path):
    job = fake_job(tmp_path, workers=1)
    with pytest.raises(RoleDiedError, match=f"rollout-0 was lost {REPLACE_ATTEMPTS + 1} times inside update 1, each replacement in turn"):
        run(job, FakeRoles([Fault(worker=0, update=1, every_time=True)]), 3)


def test_a_worker_that_never_finishes_the_next_update_is_named_by_settle(tmp_path):
    job = fake_job(tmp_path, staleness=1, wait_timeout_s=1)
    with pytest.raises(NoAnswerError, match="rollout groups of update 2: no answer after 1 s from rollout-1"):
        run(job, FakeRoles([Fault(worker=1, update=2, how="freeze")]), 3)


def test_a_worker_lost_during_the_broadcast_is_replaced_and_synced(tmp_path, capsys):
    job = fake_job(tmp_path, staleness=1)
    driver, _ = run(job, FakeRoles([Fault(worker=0, update=3, at="receive")]), 5)
    matches_reference(driver, 5)
    assert "rollout-0 died during the weight broadcast v3: replaced, and the weights sent again" in capsys.readouterr().out
    assert driver.metrics.restart_counts == {"rollout": 1}


def test_settle_is_what_keeps_a_weight_write_from_landing_on_groups_being_sampled(tmp_path, monkeypatch):
    """A vLLM-like worker refuses a weight write while it samples (engines/vllm/engine.py). Staleness 1 submits the
    next update while the learners train; the driver waits for those groups before the broadcast. Without that
    wait, the broadcast is refused."""
    job = fake_job(tmp_path, staleness=1)
    driver, _ = run(job, FakeRoles(concurrent=True, sample_seconds=0.05), 4)
    matches_reference(driver, 4)
    monkeypatch.setattr(Driver, "settle", lambda self, pending: [])
    with pytest.raises(WeightUpdateRefused, match=r"rollout-\d: a weight update while \d group\(s\) are being sampled"):
        run(fake_job(tmp_path, staleness=1, name="no-settle"), FakeRoles(concurrent=True, sample_seconds=0.05), 4)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_resume_from_a_checkpoint_with_groups_in_flight_trains_what_the_uninterrupted_run_does(tmp_path, staleness):
    """Checkpoint step-2 is written while update 2's groups (staleness 1) are still being sampled: it waits for them and
    keeps them. The driver then dies after update 2; the resume restores step-2, trains the kept groups (sampled by v1,
    one behind v2: within the bound) and goes on, and the run ends on the uninterrupted run's weights."""
    job = fake_job(tmp_path, staleness=staleness, every=2, total=6)
    first, _ = run(job, FakeRoles(sample_seconds=0.02), 3)  # writes step-2, trains update 2, dies before step-4
    assert first.checkpoints.latest() == "step-2"
    resumed, logs = run(job, FakeRoles(), 4, resume=True)
    assert resumed.restored.tag == "step-2"
    assert len(resumed.restored.in_flight) == (4 if staleness else 0)  # update 2's groups, one per prompt
    assert [log.step for log in logs] == [2, 3, 4, 5]
    assert [log.staleness for log in logs] == [staleness] * 4
    matches_reference(resumed, 6, first=2)


def test_a_pool_that_fails_to_start_stops_the_ones_already_started(tmp_path):
    roles = FakeRoles(learners_fail_to_start=True)
    with pytest.raises(NoAnswerError, match="learner-1"):
        Driver(fake_job(tmp_path), roles=roles)
    assert sorted(roles.stopped) == ["learners", "rollout workers", "teacher"]


def test_a_judge_pool_that_fails_to_start_stops_itself_and_the_pools_started_beside_it(tmp_path):
    """A reward judged by a model (GRPO: no teacher pool): its Serve pool starts first and never answers; the run
    ends naming it, and every pool it started, the judge's included, is stopped."""
    data = fake_job(tmp_path).model_dump()
    data["objective"]["mode"] = "grpo"
    data["reward"].update(name="judge", judge=str(tmp_path / "fake-model"))
    job = JobConfig.model_validate(data)
    assert job.reward.uses_judge and not job.objective.teacher_scores
    roles = FakeRoles(judge_fails_to_start=True)
    with pytest.raises(NoAnswerError, match="reward judge: no answer after 1800 s"):
        Driver(job, roles=roles)
    assert sorted(roles.stopped) == ["learners", "reward judge", "rollout workers"]
