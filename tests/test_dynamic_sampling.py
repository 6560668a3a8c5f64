"""DAPO's dynamic sampling, Ray-free: which groups are flat, which rows replace them, and the job settings it needs.
(The driver running it against the reference: tests/test_runtime.py.)"""

from __future__ import annotations

import pytest

from lt_opd_ray.core.dynamic_sampling import is_flat, reserve_rows
from lt_opd_ray.core.samples import Sample


def rows(count: int) -> list[Sample]:
    return [Sample(uid=f"row-{i}", images=("x.png",), question="Q?") for i in range(count)]


def test_a_group_is_flat_when_every_response_has_the_same_reward():
    assert is_flat([1.0, 1.0, 1.0]) and is_flat([0.0]) and is_flat([-0.5, -0.5])
    assert not is_flat([1.0, 1.0, 0.0]) and not is_flat([0.3, 0.30000001])


def test_reserved_rows_are_seeded_by_update_slot_and_round_and_pass_over_the_rows_taken():
    data = rows(50)
    sampled = {s.uid for s in data[:8]}
    reserved = reserve_rows(data, 7, 3, sampled, [5, 1], 2)
    assert reserved == reserve_rows(data, 7, 3, sampled, [1, 5], 2)  # the same rows, whatever the order asked in
    assert sorted(reserved) == [1, 5] and all(len(chain) == 2 for chain in reserved.values())
    uids = [row.uid for chain in reserved.values() for row in chain]
    assert not sampled & set(uids) and len(set(uids)) == 4  # none the update samples, none twice
    # slot 1 comes first: its chain depends on (seed, update, slot, round) alone, asked alone the same
    assert reserve_rows(data, 7, 3, sampled, [1], 2) == {1: reserved[1]}
    others = [reserve_rows(data, *key, sampled, [1], 1)[1][0].uid for key in [(8, 3), (7, 4)]]
    assert len({reserved[1][0].uid, *others}) > 1  # another seed or update draws from another generator


def test_no_row_is_reserved_twice_while_another_is_left_then_rows_repeat():
    """12 rows, 4 of them the update's own, 4 slots of 2 rounds: the 8 others, each once; with a third round there is
    nothing left, and rows repeat."""
    data = rows(12)
    sampled = {s.uid for s in data[:4]}
    reserved = reserve_rows(data, 0, 5, sampled, [0, 1, 2, 3], 2)
    uids = [row.uid for chain in reserved.values() for row in chain]
    assert sorted(uids) == sorted(s.uid for s in data[4:])
    third = [chain[2].uid for chain in reserve_rows(data, 0, 5, sampled, [0, 1, 2, 3], 3).values()]
    assert set(third) <= {s.uid for s in data}  # nothing else to draw
    assert reserve_rows(data[:1], 0, 0, {"row-0"}, [0], 1) == {0: [data[0]]}


def test_dynamic_sampling_is_refused_where_it_cannot_apply():
    from lt_opd_ray.config.loading import JobConfigError, parse_job

    minimal = "model: {path: 'tiny:qwen3_5'}\ndata: {path: 'synthetic:8'}\nreward: {name: answer, dynamic_sampling_rounds: 2}\n"
    for extra, message in [
        ("", "objective.mode lt_opd takes no advantage (grpo, dapo, gspo do)"),
        ("objective: {mode: dapo}\nschedule: {group_prompts: 2}\n", "set schedule.group_prompts to 1 (it is 2)"),
    ]:
        with pytest.raises((ValueError, JobConfigError)) as refused:
            parse_job(minimal + extra)
        assert message in str(refused.value)
    assert parse_job(minimal + "objective: {mode: dapo}\n").reward.dynamic_sampling_rounds == 2


def test_a_flat_slot_moves_on_while_another_slot_is_still_sampling():
    """The driver's dynamic sampling (runtime/dynamic_rounds.py) over two slots: slot 0's group comes back flat at
    once, slot 1's is still being sampled. Slot 0 is given its reserved row and sampled again then, not once slot 1's
    group is in (here slot 1 finishes only after that: a driver that waited for the whole round would wait out
    schedule.wait_timeout_s). The rows and counts are those of the reserved chain."""
    from concurrent.futures import Future

    from fake_roles import LocalObjects

    from lt_opd_ray.config.loading import parse_job
    from lt_opd_ray.core.wire import RolloutSummary, Span
    from lt_opd_ray.runtime.dynamic_rounds import DynamicSampling
    from lt_opd_ray.runtime.in_flight import InFlight
    from lt_opd_ray.runtime.rollout_pool import GroupRef

    job = parse_job("model: {path: 'tiny:qwen3_5'}\ndata: {path: 'synthetic:8'}\nobjective: {mode: dapo}\n"
                    "reward: {name: answer, dynamic_sampling_rounds: 1}\nsampling: {prompts_per_step: 2, n: 2}\n"
                    "schedule: {wait_timeout_s: 5}\n")
    data = rows(20)

    def summary(rewards) -> Future:
        done = Future()
        done.set_result(RolloutSummary(4, Span("rollout", "w", "u0", 0.0, 0.0), rewards))
        return done

    class Pool:
        names = ["rollout-0", "rollout-1"]

        def __init__(self):
            self.submitted, self.slot_1 = [], Future()

        def submit_groups(self, rows_ref, bounds, budget_bps, update, workers):
            self.submitted.append((dict(objects.get(rows_ref)), workers))
            self.slot_1.set_result(RolloutSummary(4, Span("rollout", "w", "u0", 0.0, 0.0), (1.0, 0.0)))  # slot 1's tail ends now
            return [GroupRef(update, start, stop, rank, workers[0], Future(), summary((0.0, 1.0))) for start, stop, rank in bounds]

    class Sampling(DynamicSampling):
        def __init__(self):
            self.job, self.samples, self.objects, self.rollouts = job, data, objects, Pool()
            self.lost_workers = set()

        def live_workers(self):
            return [0, 1]

    objects = LocalObjects()
    driver = Sampling()
    flight = InFlight(0, 500, data[:2], objects.put(data[:2]),
                      [GroupRef(0, 0, 1, 0, 0, Future(), summary((1.0, 1.0))), GroupRef(0, 1, 2, 0, 1, Future(), driver.rollouts.slot_1)])
    driver.resample_flat_groups(flight)
    reserved = reserve_rows(data, job.data.shuffle_seed, 0, {"row-0", "row-1"}, [0, 1], 1)
    assert [rows_given for rows_given, _ in driver.rollouts.submitted] == [{0: reserved[0][0]}]
    assert (flight.batch[0], flight.drawn, flight.resampled, flight.flat) == (reserved[0][0], {0: reserved[0][0].uid}, 1, 0)
