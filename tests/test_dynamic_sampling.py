"""DAPO's dynamic sampling, Ray-free: which groups are flat, which rows replace them, and the job settings it needs.
(The driver running it against the reference: tests/test_runtime.py.)"""

from __future__ import annotations

import pytest

from lt_opd_ray.core.dynamic_sampling import draw_replacements, is_flat
from lt_opd_ray.core.samples import Sample


def rows(count: int) -> list[Sample]:
    return [Sample(uid=f"row-{i}", images=("x.png",), question="Q?") for i in range(count)]


def test_a_group_is_flat_when_every_response_has_the_same_reward():
    assert is_flat([1.0, 1.0, 1.0]) and is_flat([0.0]) and is_flat([-0.5, -0.5])
    assert not is_flat([1.0, 1.0, 0.0]) and not is_flat([0.3, 0.30000001])


def test_replacements_are_seeded_by_update_slot_and_round_and_pass_over_the_rows_tried():
    data = rows(50)
    tried = {s.uid for s in data[:8]}
    first = draw_replacements(data, 7, 3, 1, tried, [5, 1])
    assert first == draw_replacements(data, 7, 3, 1, tried, [1, 5])  # the same rows, whatever the order asked in
    assert sorted(first) == [1, 5]
    assert not tried & {s.uid for s in first.values()} and first[1].uid != first[5].uid
    # slot 1's row depends on (seed, update, slot, round) alone where nothing it draws is taken: asked alone, the same
    assert draw_replacements(data, 7, 3, 1, tried, [1]) == {1: first[1]}
    others = [draw_replacements(data, *key, tried, [1])[1].uid for key in [(8, 3, 1), (7, 4, 1), (7, 3, 2)]]
    assert len({first[1].uid, *others}) > 1  # another seed, update or round draws from another generator


def test_later_rounds_never_draw_a_row_the_update_sampled_while_another_is_left():
    """Rounds of one update on 12 rows, 4 slots: a row tried (the update's own, or drawn in an earlier round) would
    give the same responses again; none is drawn until all 12 are tried, then rows repeat."""
    data = rows(12)
    tried = {s.uid for s in data[:4]}
    for round_ in (1, 2):
        drawn = draw_replacements(data, 0, 5, round_, tried, [0, 1, 2, 3])
        assert not tried & {s.uid for s in drawn.values()} and len({s.uid for s in drawn.values()}) == 4, round_
        tried |= {s.uid for s in drawn.values()}
    assert len(tried) == 12
    assert {s.uid for s in draw_replacements(data, 0, 5, 3, tried, [0, 1]).values()} <= tried  # nothing else to draw


def test_replacements_repeat_rows_only_once_every_row_is_tried():
    data = rows(4)
    drawn = draw_replacements(data, 0, 0, 1, {"row-0", "row-1"}, [0, 1, 2])  # two rows left for three slots
    uids = [drawn[slot].uid for slot in (0, 1, 2)]
    assert set(uids[:2]) == {"row-2", "row-3"} and uids[2] in {s.uid for s in data}
    assert draw_replacements(data[:1], 0, 0, 1, {"row-0"}, [0]) == {0: data[0]}  # nothing else to draw


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
