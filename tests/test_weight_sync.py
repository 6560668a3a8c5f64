"""Weight sync over a real gloo group (sender and receiver in two threads), and payload checks at the learner's boundary."""

import threading

import numpy as np
import pytest
import torch

from lt_opd_ray.core.wire import MalformedPayloadError, Rollout, TeacherScore, pack_scores, unpack_scores
from lt_opd_ray.runtime.learner_group import free_port
from lt_opd_ray.weight_sync.ends import ModuleSink, TensorSource, WeightUpdateRefused
from lt_opd_ray.weight_sync.group import SyncGroup, host_store, join_store
from lt_opd_ray.weight_sync.layout import Layout, group_key, weights_checksum


def model(seed, width=40):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(30, width), torch.nn.Linear(width, 7))


class RecordingSink(ModuleSink):
    """A module sink that also records each tensor it is handed: its dtype and the bytes of the buffer under it."""

    def __init__(self, module):
        super().__init__(module)
        self.written = []

    def write(self, stream):
        def recorded():
            for name, tensor in stream:
                self.written.append((name, tensor.dtype, tensor.untyped_storage().nbytes()))
                yield name, tensor

        super().write(recorded())


def broadcast(sender, sink, version, expected, bucket_bytes=1024, dtype="float32"):
    port = free_port()
    store = host_store("127.0.0.1", port, 2, 30)
    errors, received = [], {}

    def receive():
        try:
            group = SyncGroup(join_store("127.0.0.1", port, 30), 1, 2, 0, 30)
            received["version"] = group.receive(sink, expected)
        except Exception as exc:  # surfaced to the test below
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    sent = SyncGroup(store, 0, 2, 0, 30).send(TensorSource(list(sender.named_parameters()), dtype), version, bucket_bytes)
    thread.join(timeout=60)
    return sent, received, errors


def test_bucketed_broadcast_copies_every_weight_and_version():
    a, b = model(0), model(1)
    sent, received, errors = broadcast(a, ModuleSink(b), version=3, expected=3, bucket_bytes=1024)
    assert not errors and received == {"version": 3}
    assert weights_checksum(a.named_parameters()) == weights_checksum(b.named_parameters())
    assert sent == 4 * sum(p.numel() for p in a.parameters())


def test_bf16_wire_sends_half_the_bytes_and_the_receiver_holds_the_rounded_weights():
    a, b = model(0), model(1)
    sink = RecordingSink(b)
    sent, received, errors = broadcast(a, sink, version=1, expected=1, bucket_bytes=1024, dtype="bfloat16")
    assert not errors and sent == 2 * sum(p.numel() for p in a.parameters())
    assert {dtype for _, dtype, _ in sink.written} == {torch.bfloat16}
    assert weights_checksum(a.named_parameters(), torch.bfloat16) == weights_checksum(b.named_parameters(), torch.bfloat16)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pb, pa.detach().bfloat16().float()), name  # fp32 receiver: exactly the bf16-rounded weights


def test_the_receiver_holds_one_bucket_at_a_time():
    a, b = model(0, width=400), model(1, width=400)
    sink = RecordingSink(b)
    _, _, errors = broadcast(a, sink, version=1, expected=1, bucket_bytes=4096)
    assert not errors
    total = 4 * sum(p.numel() for p in a.parameters())
    biggest_layer = 4 * max(sum(p.numel() for p in layer.parameters()) for layer in a)  # weight + bias travel together
    assert max(nbytes for _, _, nbytes in sink.written) <= max(4096, biggest_layer) < total


def test_wrong_version_is_refused_and_nothing_changes():
    a, b = model(0), model(1)
    before = weights_checksum(b.named_parameters())
    _, _, errors = broadcast(a, ModuleSink(b), version=4, expected=3)
    assert len(errors) == 1 and isinstance(errors[0], WeightUpdateRefused) and "got version 4, expected 3" in str(errors[0])
    assert weights_checksum(b.named_parameters()) == before


def test_mismatched_names_or_shapes_are_refused_before_any_weight_changes():
    a, b = model(0, width=40), model(1, width=41)
    before = weights_checksum(b.named_parameters())
    _, _, errors = broadcast(a, ModuleSink(b), version=1, expected=1)
    assert isinstance(errors[0], WeightUpdateRefused) and "names/shapes differ" in str(errors[0])
    assert "0.weight: shape (40, 30) != (41, 30)" in str(errors[0])
    assert weights_checksum(b.named_parameters()) == before


def test_buckets_pack_in_order_within_the_size_and_never_split_a_layer():
    layout = Layout(("a", "b", "c", "d"), ((10,), (300,), (5, 5), (2,)), "float32")
    buckets = layout.buckets(400)  # 100 fp32 per bucket
    assert [b.names for b in buckets] == [("a",), ("b",), ("c", "d")]
    assert sum(b.numel for b in buckets) == 10 + 300 + 25 + 2
    names = ("model.embed.weight", "model.layers.0.q.weight", "model.layers.0.k.weight", "model.layers.1.q.weight", "lm_head.weight")
    layers = Layout(names, ((4,), (4,), (4,), (4,), (4,)), "bfloat16").buckets(8)  # one 4-element tensor per bucket
    assert [b.names for b in layers] == [names[:1], names[1:3], names[3:4], names[4:]]  # layer 0 stays whole
    assert group_key("model.visual.blocks.12.attn.qkv.weight") == "model.visual.blocks.12"
    assert group_key("model.visual.merger.linear_fc1.weight") == "model.visual.merger.linear_fc1"


def test_layout_survives_the_wire_encoding():
    layout = Layout(("x.weight", "y.bias"), ((3, 2), (7,)), "bfloat16")
    assert Layout.decode(layout.encode()) == layout


def rollouts_and_scores(lengths=(3, 2), k=4, vocab=50):
    g = torch.Generator().manual_seed(0)
    rollouts, scores = [], []
    for i, t in enumerate(lengths):
        rollouts.append(Rollout(i, torch.randint(0, vocab, (t,), generator=g), torch.zeros(t), torch.randint(0, vocab, (t, k), generator=g), [torch.arange(2)], 500, "eos"))
        logp = torch.log_softmax(torch.randn(t, vocab, generator=g), -1)
        top = logp.topk(k, -1)
        scores.append(TeacherScore(top.indices.to(torch.int32), top.values, logp[:, :k + 1]))
    return rollouts, scores


@pytest.mark.parametrize("dtype, bytes_per_token", [("float32", 4 * 4 + 4 * 4 + 5 * 4), ("float16", 4 * 4 + 4 * 2 + 5 * 2)])
def test_payload_round_trip_and_bytes_per_token(dtype, bytes_per_token):
    rollouts, scores = rollouts_and_scores()
    payload = pack_scores(scores, dtype)
    assert payload.top_ids.dtype == np.int32
    assert payload.bytes_per_token == pytest.approx(bytes_per_token + 4 * 2 / 5)  # + the two int32 lengths over 5 positions
    back = unpack_scores(payload, rollouts, vocab_size=50)
    tol = 0 if dtype == "float32" else 1e-2
    for a, b in zip(back, scores):
        assert torch.equal(a.top_ids, b.top_ids)
        torch.testing.assert_close(a.top_logp, b.top_logp, atol=tol, rtol=tol)


def test_a_rollout_carries_the_students_top_k_ids_as_int32_and_refuses_an_id_int32_cannot_hold():
    from types import SimpleNamespace

    from lt_opd_ray.core.wire import token_ids32

    top = torch.tensor([[3, 248_319], [0, 7]])  # int64, as both engines return them; Qwen3.5's last id
    completion = SimpleNamespace(token_ids=torch.tensor([5, 6]), logprobs=torch.zeros(2), top_ids=top, finish_reason="stop")
    rollout = Rollout.sampled(0, completion, [torch.arange(2)], None, 500)
    assert rollout.student_top_ids.dtype == torch.int32 and torch.equal(rollout.student_top_ids.long(), top)
    assert rollout.student_top_ids.nbytes == top.nbytes // 2
    with pytest.raises(ValueError, match=r"token id 2147483648 does not fit int32"):
        token_ids32(torch.tensor([[1, 2**31]]))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: setattr(p, "lengths", p.lengths[:1]), "1 lengths for 2 rollouts"),
        (lambda p: setattr(p, "lengths", np.array([2, 3], dtype=np.int32)), "rollout 0 has 3 response tokens but the payload has 2"),
        (lambda p: setattr(p, "top_ids", p.top_ids.astype(np.int64)), "top_ids must be int32"),
        (lambda p: setattr(p, "top_ids", p.top_ids + 1000), r"top_ids outside the vocabulary \[0, 50\)"),
        (lambda p: setattr(p, "top_logp", -p.top_logp), "top_logp holds values that are not log-probabilities"),
        (lambda p: setattr(p, "requested_logp", p.requested_logp[:, :2]), "requested_logp has shape"),
        (lambda p: p.top_logp.__setitem__((0, 0), np.nan), "non-finite"),
    ],
)
def test_malformed_teacher_payload_is_caught_at_the_boundary(corrupt, message):
    rollouts, scores = rollouts_and_scores()
    payload = pack_scores(scores, "float32")
    corrupt(payload)
    with pytest.raises(MalformedPayloadError, match=f"malformed teacher payload from replica-7: .*{message}"):
        unpack_scores(payload, rollouts, vocab_size=50, source="replica-7")
    with pytest.raises(MalformedPayloadError, match="expected a TeacherPayload, got dict"):
        unpack_scores({"top_ids": 1}, rollouts, 50, source="replica-7")
