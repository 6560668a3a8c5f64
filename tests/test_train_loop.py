import itertools

import pytest

from lt_opd_ray.core.batch_order import batches
from lt_opd_ray.core.samples import Sample

SAMPLES = [Sample(uid=f"u{i}", images=(None,), question="q") for i in range(10)]


def uids(batch):
    return [s.uid for s in batch]


def test_every_sample_once_per_epoch_even_when_batches_span_epochs():
    stream = [s.uid for batch in itertools.islice(batches(SAMPLES, 3, shuffle_seed=1), 10) for s in batch]  # 30 = 3 epochs
    for epoch in range(3):
        assert sorted(stream[10 * epoch : 10 * epoch + 10]) == sorted(s.uid for s in SAMPLES)
    assert stream[:10] != stream[10:20]  # reshuffled each epoch


def test_resuming_from_a_cursor_continues_exactly():
    straight = [uids(b) for b in itertools.islice(batches(SAMPLES, 4, shuffle_seed=7), 6)]
    resumed = [uids(b) for b in itertools.islice(batches(SAMPLES, 4, shuffle_seed=7, cursor=12), 3)]
    assert resumed == straight[3:]


def test_batch_larger_than_the_data_is_refused():
    with pytest.raises(ValueError, match=r"prompts_per_step \(11\) must lie in \[1, 10\]"):
        next(batches(SAMPLES, 11, 0))
