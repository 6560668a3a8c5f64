"""The pruned models under vLLM's V2 model runner (its default on CUDA), on CPU through vLLM's own V2 classes.

V2 cannot run a model on CPU (its buffers are pinned or on the GPU), so what is exercised here is each V2 line our
models meet: the state class V2 resolves for them, and V2's multimodal pruner driving our position hook over a batch
of requests, checked against the hook called as V1 calls it and against a brute-force walk.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache  # noqa: E402
from vllm.v1.worker.gpu.model_states import resolve_model_state_cls  # noqa: E402
from vllm.v1.worker.gpu.model_states.default import DefaultModelState  # noqa: E402
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState  # noqa: E402
from vllm.v1.worker.gpu.model_states.mm_pruning import MultiModalPruner  # noqa: E402

from lt_opd_ray.engines.vllm import models as vllm_models  # noqa: E402
from lt_opd_ray.engines.vllm.models import POSITION_CHANNELS, PruningModelMixin  # noqa: E402

IMAGE, VIDEO, START = 7, 9, 6  # image pad, video pad and vision-start token ids of the prompts below
SLOTS = (IMAGE, VIDEO)
HIDDEN = 5


def walk_reference(ids: list[int], rows: list[torch.Tensor], positions: torch.Tensor, num_computed: int):
    """Brute force: every slot walks back to its run's <|vision_start|> (an image's, or a clip's temporal patch's)."""
    out = positions.clone()
    slots = [i for i, t in enumerate(ids) if t in SLOTS and i >= num_computed]
    offsets = [o for r in rows for o in r[:, -POSITION_CHANNELS:].round().long().tolist()]
    for slot, offset in zip(slots, offsets):
        start = slot
        while ids[start - 1] in SLOTS:
            start -= 1
        out[:, slot] = out[0, start - 1] + 1 + torch.tensor(offset)
    return out


def prompt(rng: torch.Generator, images: int) -> tuple[list[int], list[tuple[int, int]], list[torch.Tensor], torch.Tensor]:
    """(token ids, (offset, length) per run, rows with offset channels per run, initial M-RoPE positions): each run an
    image or a clip's temporal patch."""
    ids, spans, rows = [1, 2], [], []
    for _ in range(images):
        k = int(torch.randint(1, 9, (1,), generator=rng))
        ids += [START]
        spans.append((len(ids), k))
        ids += [SLOTS[int(torch.randint(0, 2, (1,), generator=rng))]] * k + [8] + [3] * int(torch.randint(0, 4, (1,), generator=rng))
        offsets = torch.randint(0, 6, (k, 3), generator=rng).float()
        rows.append(torch.cat([torch.randn(k, HIDDEN, generator=rng), offsets], dim=1))
    positions = torch.arange(len(ids)).expand(3, -1).clone() * 2  # anything: text positions are left as they are
    return ids, spans, rows, positions


def model():
    """Our hook on an object holding what it reads of the model (its config's family and image and video token ids)."""
    pruned = SimpleNamespace(config=SimpleNamespace(model_type="qwen3_vl", image_token_id=IMAGE, video_token_id=VIDEO))
    pruned.recompute_mrope_positions = PruningModelMixin.recompute_mrope_positions.__get__(pruned)
    return pruned


@pytest.mark.parametrize("seed", range(20))
def test_the_vectorised_hook_equals_the_brute_force_walk(seed):
    rng = torch.Generator().manual_seed(seed)
    ids, spans, rows, positions = prompt(rng, images=int(torch.randint(1, 4, (1,), generator=rng)))
    first = spans[int(torch.randint(0, len(spans), (1,), generator=rng))][0]  # a chunk that starts at an image
    chosen = [r for (offset, _), r in zip(spans, rows) if offset >= first]
    cleaned, got, delta = model().recompute_mrope_positions(ids, chosen, positions, first)
    want = walk_reference(ids, chosen, positions, first)
    assert torch.equal(got, want)
    assert delta == int(want.max()) + 1 - len(ids)
    assert all(torch.equal(c, r[:, :HIDDEN]) for c, r in zip(cleaned, chosen))


def test_v2_resolves_our_state_classes_from_the_classes_it_would_pick():
    hybrid, default = resolve_model_state_cls(None, vllm_models.PrunedQwen3_5ForConditionalGeneration), resolve_model_state_cls(None, vllm_models.PrunedQwen3VLForConditionalGeneration)
    assert issubclass(hybrid, MambaHybridModelState) and hybrid.__name__ == "PruningMambaHybridModelState"  # Gated DeltaNet layers
    assert issubclass(default, DefaultModelState) and not issubclass(default, MambaHybridModelState)
    assert resolve_model_state_cls(None, vllm_models.PrunedQwen2_5_VLForConditionalGeneration) is default  # one class per base, cached


class PrefillPositions:
    """RopeState's staged prefill positions as a plain tensor (vLLM's own buffer needs pinned memory, so CUDA)."""

    def __init__(self, per_request: list[torch.Tensor]):
        self.positions = [p.clone() for p in per_request]
        self.deltas = [None] * len(per_request)

    def read_prefill_positions(self, req_idx: int, length: int) -> torch.Tensor:
        return self.positions[req_idx][:, :length]

    def update_prefill_positions(self, req_idx: int, positions: torch.Tensor, delta: int) -> None:
        self.positions[req_idx][:, : positions.shape[1]].copy_(positions)
        self.deltas[req_idx] = delta


def test_v2s_pruner_drives_the_hook_over_a_batch_as_v1_calls_it_per_request():
    rng = torch.Generator().manual_seed(0)
    requests = [prompt(rng, images=n) for n in (2, 1, 3)]
    cache = EncoderCache()
    for r, (ids, spans, rows, _) in enumerate(requests):
        cache.add_request(f"req-{r}", [
            MultiModalFeatureSpec(data=None, modality="image", identifier=f"{r}-{i}", mm_position=PlaceholderRange(offset, length))
            for i, (offset, length) in enumerate(spans)
        ])
    # request 1 has computed its first image in an earlier step; the others prefill from the start
    computed = [0, len(requests[1][0]), 0]
    computed[1] = requests[1][1][0][0] + requests[1][1][0][1]  # past its only image: it contributes no rows now
    scheduled = [len(ids) - c for (ids, *_), c in zip(requests, computed)]
    longest = max(len(ids) for ids, *_ in requests)
    tokens = torch.zeros(len(requests), longest, dtype=torch.long)
    for r, (ids, *_) in enumerate(requests):
        tokens[r, : len(ids)] = torch.tensor(ids)
    batch = SimpleNamespace(
        req_ids=[f"req-{r}" for r in range(len(requests))], idx_mapping_np=torch.arange(len(requests)).numpy(),
        prefill_len_np=torch.tensor([len(ids) for ids, *_ in requests]).numpy(),
        num_computed_prefill_tokens_np=torch.tensor(computed).numpy(), num_scheduled_tokens=torch.tensor(scheduled).numpy(),
    )
    rope = PrefillPositions([positions for *_, positions in requests])
    flat = [rows for r, (ids, spans, rows, _) in enumerate(requests) for (offset, _), rows in zip(spans, rows) if offset >= computed[r]]
    pruner = MultiModalPruner(model(), rope, cache, inputs_embeds_size=HIDDEN)
    cleaned = pruner.recompute(flat, batch, SimpleNamespace(all_token_ids=SimpleNamespace(gpu=tokens)))
    assert [c.shape for c in cleaned] == [torch.Size([r.shape[0], HIDDEN]) for r in flat]
    for r, (ids, spans, rows, positions) in enumerate(requests):
        chosen = [rw for (offset, _), rw in zip(spans, rows) if offset >= computed[r]]
        if not chosen:
            assert rope.deltas[r] is None and torch.equal(rope.positions[r], positions)  # untouched, as V2 skips it
            continue
        _, v1, v1_delta = model().recompute_mrope_positions(ids, chosen, positions, computed[r])  # as V1's runner calls it
        assert torch.equal(rope.positions[r], v1) and rope.deltas[r] == v1_delta
        assert torch.equal(v1, walk_reference(ids, chosen, positions, computed[r]))
