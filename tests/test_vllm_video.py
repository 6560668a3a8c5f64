"""Clips in the vLLM engines (CPU build) against the transformers path, on tiny real models of each clip layout:
Qwen3-VL (each temporal patch after its timestamp), Qwen2.5-VL (every patch in one run, temporal positions spaced by
the clip's rate), GLM-4V (each patch before its whole seconds). At 100% the engine's expanded prompt is our
processor's; at a lower budget each temporal patch's picks are the adapter's, and the greedy tokens and log-probs are
the transformers path's on those picks; the teacher's full-token scores of a clip are the transformers teacher's."""

from __future__ import annotations

import pytest
import torch
from conftest import random_image
from test_video import clip_of
from test_vllm_engine import BUDGET_BPS, GREEDY, K_MIN, LOGP_TOL, _adapter, _selections

from lt_opd_ray.core.samples import Sample

import vllm  # noqa: E402, F401  (the real engine: a broken vLLM install fails here, never skips)

CLIP_FAMILIES = ["qwen3_vl", "qwen2_5_vl", "glm4v"]  # one family per clip layout (core/families.py)
FRAMES = 8  # 4 temporal patches
BOUNDS = dict(min_pixels=1024, max_pixels=4096)  # a job's image bounds: the 64 x 64 images fit, the 64 x 96 frames keep the
# video processor's own bounds (vLLM's Qwen processors would shrink them to these)
# vLLM's own Qwen2.5-VL already differs from transformers on a clip at 100% of its tokens, no pruning involved: up to
# 5.9e-4 on the rollout's greedy log-probs and 3.0e-3 on the teacher's top-k (measured on this tiny model; 1.0e-3 on
# the rollout once pruned to 25%). Its clips are held to 5e-3, the others as their images. Positions are not what this
# tolerance hides: a clip with its temporal positions zeroed samples other tokens.
CLIP_LOGP_TOL = LOGP_TOL | {"qwen2_5_vl": 5e-3}


def _clip_prompts(tiny_dir, family, count=2):
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples

    processor = VLMProcessor(tiny_dir, frames=FRAMES, **BOUNDS)
    images = 1 if processor.family.image_beside_clip else 0  # GLM-4V: a clip alone
    samples = [Sample(uid=f"clip-{i}", images=tuple(random_image(i, 64, 64) for _ in range(images)), question="What happens in the video?",
                      video=clip_of(frames=12, seed=i)) for i in range(count)]
    return processor, samples, encode_samples(processor, samples)


@pytest.fixture(scope="module")
def clip_engines(tiny_dirs):
    from lt_opd_ray.engines.vllm.engine import VLLMEngine

    built = {}

    def get(family):
        if family not in built:
            built[family] = VLLMEngine(tiny_dirs[family], dtype="float32", max_model_len=2048, max_videos=1, **BOUNDS)
        return built[family]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", CLIP_FAMILIES)
def test_a_pruned_clip_equals_the_transformers_path_with_the_same_picks(family, tiny_dirs, clip_engines):
    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.engines.vllm.engine import engine_prompt
    from lt_opd_ray.models.sampler import sample

    engine = clip_engines(family)
    processor, samples, prompts = _clip_prompts(tiny_dirs[family], family)
    engine_prompts = [engine_prompt(p, list(s.images), engine.video_token_id) for p, s in zip(prompts, samples)]
    selections = _selections(len(prompts))
    results = engine.generate(engine_prompts, selections, GREEDY, seeds=[1, 2])
    vlm = _adapter(tiny_dirs[family])
    for prompt, selection, (completion, kept) in zip(prompts, selections, results):
        features = vlm.visual_features(prompt)
        assert len(kept.indices) == len(prompt.visual_units) == prompt.num_images + FRAMES // 2
        assert [k.numel() for k in kept.indices] == [tokens_to_keep(e.shape[0], BUDGET_BPS, K_MIN) for e in features.embeds]
        own = vlm.select(prompt, features, build_selector("cdpruner"), BUDGET_BPS, K_MIN, seed=selection.seed)
        assert all(torch.equal(a, b) for a, b in zip(kept.indices, own))
        reference = sample(vlm, [vlm.reduce(prompt, features, kept.indices)], GREEDY, [0], processor.tokenizer)[0]
        assert completion.token_ids.tolist() == reference.token_ids.tolist()
        assert (completion.logprobs - reference.logprobs).abs().max() <= CLIP_LOGP_TOL[family]


@pytest.mark.slow
@pytest.mark.parametrize("family", CLIP_FAMILIES)
def test_a_clips_teacher_scores_equal_the_transformers_teacher(family, tiny_dirs, clip_engines):
    """Full-token scoring: the engine expands each clip exactly as our processor writes it (timestamps, markers,
    every frame token, their positions), or the scores would differ."""
    from lt_opd_ray.core.wire import Rollout
    from lt_opd_ray.engines.transformers.teacher import teacher_scores
    from lt_opd_ray.engines.vllm.roles import vllm_teacher_scores

    engine = clip_engines(family)
    _, samples, prompts = _clip_prompts(tiny_dirs[family], family)
    responses = [torch.tensor([40, 41, 42, 43, 44]), torch.tensor([50, 51, 52])]
    student_top = [torch.randint(0, 300, (r.numel(), 4), generator=torch.Generator().manual_seed(i)) for i, r in enumerate(responses)]
    rollouts = [Rollout(i, r, torch.zeros(r.numel()), top, [], BUDGET_BPS, "length") for i, (r, top) in enumerate(zip(responses, student_top))]
    top_k = 8
    expected = teacher_scores(_adapter(tiny_dirs[family]), prompts, rollouts, top_k, chunk_size=4)
    scored = vllm_teacher_scores(engine, dict(enumerate(prompts)), {i: list(s.images) for i, s in enumerate(samples)}, rollouts, top_k)
    for got, want in zip(scored, expected):
        for mine, theirs in zip(got.top_ids.tolist(), want.top_ids.tolist()):
            assert set(mine) == set(theirs)
        assert torch.allclose(got.top_logp, want.top_logp.float(), atol=CLIP_LOGP_TOL[family], rtol=0)
        assert torch.allclose(got.requested_logp, want.requested_logp.float(), atol=CLIP_LOGP_TOL[family], rtol=0)
