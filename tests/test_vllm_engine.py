"""The vLLM engines (CPU build) against the transformers backends, on tiny real Qwen VLMs.

Rollouts: vLLM prunes inside the engine (our plugin); the transformers backend is
then given the indices vLLM chose and must produce the same greedy tokens and
log-probs. Teacher scoring: the same top-k and requested-id log-probs as
`engines/transformers/teacher.teacher_scores`. Weight updates: in place, and refused whole on a mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lt_opd_ray.models.sampler import SamplingParams
from lt_opd_ray.sources.synthetic import synthetic_sample

import vllm  # noqa: E402, F401  (the real engine: a broken vLLM install fails here, never skips)

BUDGET_BPS, K_MIN = 2500, 2
GREEDY = SamplingParams(max_new_tokens=8, greedy=True, top_k_logprobs=5, stop=())
# fp32 log-prob tolerance per family. Qwen2.5-VL: vLLM's own Qwen2.5-VL already differs from
# transformers by up to ~1.6e-4 at 100% of the tokens (no pruning involved; measured on this
# tiny model), so pruned rollouts are held to 1e-3 there.
LOGP_TOL = {"qwen3_vl": 1e-4, "qwen2_5_vl": 1e-3, "glm4v": 1e-3}


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    from lt_opd_ray.engines.vllm.engine import VLLMEngine

    built = {}

    def get(family: str):
        if family not in built:
            dtype = "bfloat16" if family == "qwen3_5" else "float32"  # vLLM's CPU GDN kernels need bf16
            built[family] = VLLMEngine(tiny_dirs[family], dtype=dtype, max_model_len=1024)
        return built[family]

    return get


def _prompts(tiny_dir, count=3):
    from lt_opd_ray.engines.vllm.engine import engine_prompt
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples

    samples = [synthetic_sample(i) for i in range(count)]
    processor = VLMProcessor(tiny_dir)
    prompts = encode_samples(processor, samples)
    return processor, prompts, [engine_prompt(p, list(s.images)) for p, s in zip(prompts, samples)]


def _adapter(tiny_dir, dtype=torch.float32):
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.loading import load_vlm

    return QwenVLM(load_vlm(str(tiny_dir))[1].eval().to(dtype))


def _selections(count):
    from lt_opd_ray.engines.vllm.selection import SelectionRequest

    return [SelectionRequest(budget_bps=BUDGET_BPS, k_min=K_MIN, selector="cdpruner", seed=11 + i) for i in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "glm4v"])
def test_pruned_rollout_equals_transformers_with_the_same_indices(family, tiny_dirs, engines):
    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.models.sampler import sample

    processor, prompts, engine_prompts = _prompts(tiny_dirs[family])
    selections = _selections(len(prompts))
    results = engines(family).generate(engine_prompts, selections, GREEDY, seeds=[1, 2, 3])
    vlm = _adapter(tiny_dirs[family])
    for prompt, selection, (completion, kept) in zip(prompts, selections, results):
        features = vlm.visual_features(prompt)
        n = features.embeds[0].shape[0]
        assert kept.indices[0].numel() == tokens_to_keep(n, BUDGET_BPS, K_MIN) < n and kept.merge_routes is None
        # the engine's CDPruner saw the same features and query as the adapter's
        own = vlm.select(prompt, features, build_selector("cdpruner"), BUDGET_BPS, K_MIN, seed=selection.seed)
        assert torch.equal(kept.indices[0], own[0])
        reference = sample(vlm, [vlm.reduce(prompt, features, kept.indices)], GREEDY, [0], processor.tokenizer)[0]
        assert completion.token_ids.tolist() == reference.token_ids.tolist()
        assert (completion.logprobs - reference.logprobs).abs().max() <= LOGP_TOL[family]
        for mine, theirs in zip(completion.top_ids.tolist(), reference.top_ids.tolist()):
            assert set(mine) == set(theirs)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "glm4v"])
def test_hiprune_in_the_engine_keeps_what_the_transformers_adapter_keeps(family, tiny_dirs, engines):
    """HiPrune reads vLLM's own tower attention (its windowed Qwen2.5-VL block among them): at 90% of an image's 36 or 64
    tokens (an anchor and its buffers, the rest registers) the engine keeps the adapter's tokens."""
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.core.selectors.hiprune import ALPHA as HIPRUNE_ALPHA
    from lt_opd_ray.engines.vllm.engine import engine_prompt
    from lt_opd_ray.engines.vllm.selection import SelectionRequest
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples

    samples = [synthetic_sample(i, size=320) for i in range(2)]
    prompts = encode_samples(VLMProcessor(tiny_dirs[family]), samples)
    selections = [SelectionRequest(budget_bps=9000, k_min=K_MIN, selector="hiprune", seed=i) for i in range(2)]
    results = engines(family).generate([engine_prompt(p, list(s.images)) for p, s in zip(prompts, samples)], selections, GREEDY, seeds=[1, 2])
    vlm = _adapter(tiny_dirs[family])
    for prompt, (_, kept) in zip(prompts, results):
        features = vlm.visual_features(prompt, with_attention=True)
        assert round(HIPRUNE_ALPHA * kept.indices[0].numel() / 5) >= 1  # an anchor
        own = vlm.select(prompt, features, build_selector("hiprune"), 9000, K_MIN)
        assert torch.equal(kept.indices[0], own[0]), family


@pytest.mark.slow
def test_two_image_prompts_prune_each_image_as_the_transformers_path(tiny_dirs):
    """Rows of two images in vLLM: each image's picks are the adapter's for that image (per-image seeds), and the
    greedy tokens and log-probs are the transformers path's on those picks."""
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.engines.vllm.engine import VLLMEngine, engine_prompt
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples
    from lt_opd_ray.models.sampler import sample

    family = "qwen3_vl"
    samples = [synthetic_sample(i, images=2, size=(96 + 32 * i, 128)) for i in range(2)]
    processor = VLMProcessor(tiny_dirs[family])
    prompts = encode_samples(processor, samples)
    engine = VLLMEngine(tiny_dirs[family], dtype="float32", max_model_len=1024, max_images=2)
    selections = _selections(len(prompts))
    results = engine.generate([engine_prompt(p, list(s.images)) for p, s in zip(prompts, samples)], selections, GREEDY, seeds=[1, 2])
    vlm = _adapter(tiny_dirs[family])
    for prompt, selection, (completion, kept) in zip(prompts, selections, results):
        features = vlm.visual_features(prompt)
        own = vlm.select(prompt, features, build_selector("cdpruner"), BUDGET_BPS, K_MIN, seed=selection.seed)
        assert len(kept.indices) == 2 and all(torch.equal(a, b) for a, b in zip(kept.indices, own))
        reference = sample(vlm, [vlm.reduce(prompt, features, kept.indices)], GREEDY, [0], processor.tokenizer)[0]
        assert completion.token_ids.tolist() == reference.token_ids.tolist()
        assert (completion.logprobs - reference.logprobs).abs().max() <= LOGP_TOL[family]


@pytest.mark.slow
def test_qwen3_5_bf16_rollout_is_as_close_to_fp32_as_transformers_bf16(tiny_dirs, engines):
    """bf16 rounds differently in every kernel, so tokens may part ways; compare log-probs teacher-forced.

    On the tokens vLLM sampled, vLLM's bf16 log-probs must be as close to the fp32
    transformers reference as transformers' own bf16 run is (within 2x, plus 0.02 for
    the very small differences where both are near zero).
    """
    family = "qwen3_5"
    _, prompts, engine_prompts = _prompts(tiny_dirs[family])
    results = engines(family).generate(engine_prompts, _selections(len(prompts)), GREEDY, seeds=[1, 2, 3])
    fp32, bf16 = _adapter(tiny_dirs[family]), _adapter(tiny_dirs[family], torch.bfloat16)

    def forced_logp(vlm, prompt, kept, ids):
        reduced = vlm.reduce(prompt, vlm.visual_features(prompt), kept)
        hidden = vlm.response_hidden([reduced], [ids])[0]
        return torch.log_softmax(vlm.lm_head(hidden).float(), -1).gather(-1, ids[:, None]).squeeze(-1)

    with torch.no_grad():
        for prompt, (completion, kept) in zip(prompts, results):
            reference = forced_logp(fp32, prompt, kept.indices, completion.token_ids)
            hf_error = (forced_logp(bf16, prompt, kept.indices, completion.token_ids) - reference).abs().max()
            vllm_error = (completion.logprobs - reference).abs().max()
            assert vllm_error <= 2 * hf_error + 0.02, (float(vllm_error), float(hf_error))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "glm4v"])
def test_teacher_scores_equal_transformers_teacher(tiny_dirs, engines, family):
    from lt_opd_ray.core.wire import Rollout
    from lt_opd_ray.engines.transformers.teacher import teacher_scores

    engine = engines(family)
    _, prompts, engine_prompts = _prompts(tiny_dirs[family])
    sampled = SamplingParams(max_new_tokens=10, top_k_logprobs=5, stop=())
    results = engine.generate(engine_prompts, _selections(len(prompts)), sampled, seeds=[5, 6, 7])
    rollouts = [
        Rollout(i, c.token_ids, c.logprobs, c.top_ids, kept.indices, BUDGET_BPS, c.finish_reason) for i, (c, kept) in enumerate(results)
    ]
    top_k = 8
    expected = teacher_scores(_adapter(tiny_dirs[family]), prompts, rollouts, top_k, chunk_size=4)
    requested = [torch.cat([r.student_top_ids, r.response_ids[:, None]], -1) for r in rollouts]
    scored = engine.score(engine_prompts, [r.response_ids for r in rollouts], requested, top_k)
    for got, want in zip(scored, expected):
        assert got.top_ids.shape == want.top_ids.shape
        for mine, theirs in zip(got.top_ids.tolist(), want.top_ids.tolist()):
            assert set(mine) == set(theirs)
        assert torch.allclose(got.top_logp, want.top_logp.float(), atol=LOGP_TOL[family], rtol=0)
        assert torch.allclose(got.requested_logp, want.requested_logp.float(), atol=LOGP_TOL[family], rtol=0)


def legacy_folder(tiny_dir, target):
    """A Qwen2.5-VL folder in its releases' tensor layout (before transformers 4.52): `visual.*`, `model.layers.*`,
    `model.embed_tokens`, which transformers renames to `model.visual.*`, `model.language_model.*` on load."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir, target)
    tensors = load_file(str(target / "model.safetensors"))
    renamed = {re.sub(r"^model\.language_model\.", "model.", re.sub(r"^model\.visual\.", "visual.", n)): t for n, t in tensors.items()}
    save_file(renamed, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl-legacy", "glm4v"])
def test_weight_update_in_place_and_refused_whole_on_mismatch(tiny_dirs, engines, family, tmp_path):
    """The learner's names (transformers' parameters) update the engine in place, every tensor moved (the q/k/v biases
    too, which the tiny models start at zero): also for a Qwen2.5-VL folder in its releases' legacy tensor names
    (vLLM's loader maps both layouts) and for GLM-4V; a bad shape or name is refused whole."""
    from safetensors import safe_open

    from lt_opd_ray.engines.vllm.engine import VLLMEngine, WeightMismatchError
    from lt_opd_ray.models.loading import check_checkpoint_names
    from lt_opd_ray.models.sampler import sample

    if family == "qwen2_5_vl-legacy":
        folder = legacy_folder(tiny_dirs["qwen2_5_vl"], tmp_path / "legacy")
        with safe_open(str(folder / "model.safetensors"), "pt") as handle:
            assert {"visual.merger.mlp.0.weight", "model.layers.0.self_attn.q_proj.bias"} <= set(handle.keys())
        check_checkpoint_names(folder)  # transformers loads it by name: the preflight lets it through
        engine = VLLMEngine(folder, dtype="float32", max_model_len=1024)
    else:
        folder, engine = tiny_dirs[family], engines(family)
    processor, prompts, engine_prompts = _prompts(folder, count=1)
    selection = _selections(1)
    before = engine.generate(engine_prompts, selection, GREEDY, seeds=[1])[0][0]

    vlm = _adapter(folder)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in vlm.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    updated = list(vlm.model.state_dict().items())

    bad_shape = [(n, t[:-1] if n.endswith("lm_head.weight") else t) for n, t in updated]
    bad_name = updated + [("model.language_model.layers.0.not_a_weight", torch.zeros(2))]
    for bad, problem in ((bad_shape, "lm_head.weight: shape"), (bad_name, "not_a_weight: not a weight")):
        with pytest.raises(WeightMismatchError, match=problem):
            engine.load_weights(bad)
        unchanged = engine.generate(engine_prompts, selection, GREEDY, seeds=[1])[0][0]
        assert torch.equal(unchanged.logprobs, before.logprobs)

    engine.load_weights(updated)
    after, kept = engine.generate(engine_prompts, selection, GREEDY, seeds=[1])[0]
    features = vlm.visual_features(prompts[0])
    reference = sample(vlm, [vlm.reduce(prompts[0], features, kept.indices)], GREEDY, [0], processor.tokenizer)[0]
    assert after.token_ids.tolist() == reference.token_ids.tolist()
    assert (after.logprobs - reference.logprobs).abs().max() <= LOGP_TOL[family.removesuffix("-legacy")]
    assert not torch.allclose(after.logprobs, before.logprobs)


@pytest.mark.slow
def test_the_held_weights_check_reloads_every_tensor_and_names_one_the_engine_left_stale(tiny_dirs, engines):
    """tests/held_weights.py's vLLM check, on an engine at hand: writing weights moved everywhere through vLLM's own
    reload changes every parameter the engine holds (none is skipped, so a stale one cannot hide); the same weights
    again change nothing; a tensor left out of the engine's own write is named, with how far it is off."""
    from held_weights import vllm_mismatches, vllm_model

    engine = engines("qwen3_5")
    vlm = _adapter(tiny_dirs["qwen3_5"])
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in vlm.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    moved = {n: p.detach().clone() for n, p in vlm.model.named_parameters()}
    parameters = {n for n, _ in vllm_model(engine).named_parameters()}
    changed = {problem.split(":")[0] for problem in vllm_mismatches(engine, moved, torch.bfloat16)}
    assert parameters <= changed  # every parameter vLLM holds was written by the reload
    assert vllm_mismatches(engine, moved, torch.bfloat16) == []
    stale = next(n for n in moved if n.endswith("layers.0.mlp.down_proj.weight"))
    with torch.no_grad():
        again = {n: t + 0.01 for n, t in moved.items()}
    engine.load_weights([(n, t.to(torch.bfloat16)) for n, t in again.items() if n != stale])  # in the dtype the sync sends
    problems = vllm_mismatches(engine, again, torch.bfloat16)
    assert len(problems) == 1 and problems[0].startswith("language_model.model.layers.0.mlp.down_proj.weight: max |held - learners'|"), problems


@pytest.mark.slow
def test_the_samples_of_a_prompt_share_one_vision_pass_and_selection(tiny_dirs, engines):
    """n identical requests carry one nonce, so vLLM sees equal multimodal inputs: one selection for the n samples.

    Before the tests that build and drop engines of their own (that resets vLLM's process-wide parallel state)."""
    family = "qwen3_vl"
    engine = engines(family)
    _, _, engine_prompts = _prompts(tiny_dirs[family], count=2)
    model = engine.llm.collective_rpc(lambda worker: worker.get_model())[0]  # the in-process engine's model
    recorded = []
    original = model._record
    model._record = lambda nonce, image, indices, route: (recorded.append(nonce), original(nonce, image, indices, route))
    try:
        n = 4
        selections = _selections(2)
        prompts = [engine_prompts[0]] * n + [engine_prompts[1]] * n
        results = engine.generate(prompts, [selections[0]] * n + [selections[1]] * n, SamplingParams(max_new_tokens=3, top_k_logprobs=2, stop=()),
                                  seeds=list(range(2 * n)))
    finally:
        model._record = original
    assert len(set(recorded)) == 2 and len(recorded) == 2  # one selection per prompt, not per sample
    kept = [k.indices[0] for _, k in results]
    assert all(torch.equal(k, kept[0]) for k in kept[:n]) and all(torch.equal(k, kept[n]) for k in kept[n:])
    assert len({tuple(c.token_ids.tolist()) for c, _ in results[:n]}) > 1  # the samples still differ (own seeds)


@pytest.mark.slow
def test_groups_called_from_several_threads_share_one_batch_and_each_gets_its_own_samples(tiny_dirs, engines):
    """A vLLM worker's rollout groups run on threads of their own: their sequences decode in one engine batch, each
    call returns as its own finish (a short group before a long one), and sampling equals one group at a time."""
    import threading
    import time

    from lt_opd_ray.engines.vllm.loop import EngineBusyError

    family = "qwen3_vl"
    engine = engines(family)
    _, _, engine_prompts = _prompts(tiny_dirs[family], count=3)
    selections = _selections(3)
    n = 4
    groups = [([engine_prompts[g]] * n, [selections[g]] * n) for g in range(3)]
    seeds = [list(range(10 * g, 10 * g + n)) for g in range(3)]
    lengths = [64, 64, 4]  # the last group is short: it must come back while the others decode
    params = [SamplingParams(max_new_tokens=t, top_k_logprobs=3, stop=()) for t in lengths]
    alone = [engine.generate(*group, params[g], seeds[g]) for g, group in enumerate(groups)]

    begin = time.perf_counter()
    results, finished_at, errors = [None] * 3, [0.0] * 3, []

    def run(g):
        try:
            results[g] = engine.generate(*groups[g], params[g], seeds[g])
            finished_at[g] = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,)) for g in range(3)]
    for thread in threads:
        thread.start()
    while not engine.loop.waiters and any(t.is_alive() for t in threads):
        time.sleep(0.001)
    def stream():  # a weight update that must not be read while sequences are sampled
        raise AssertionError("weights written while the engine was sampling")
        yield

    with pytest.raises(EngineBusyError, match="must be idle"):  # no sequence is sampled across a weight change
        engine.write_weights(stream())
    for thread in threads:
        thread.join()
    assert not errors
    steps = engine.loop.steps_since(begin)
    assert max(s.ran for s in steps) == 3 * n  # all three groups' sequences in one decode step
    assert finished_at[2] < min(finished_at[:2])  # the short group was handed back first
    for mine, theirs in zip(results, alone):
        for (a, kept_a), (b, kept_b) in zip(mine, theirs):
            assert a.token_ids.tolist() == b.token_ids.tolist()  # per-request seeds: batching changes no sample
            assert (a.logprobs - b.logprobs).abs().max() <= 1e-4
            assert torch.equal(kept_a.indices[0], kept_b.indices[0])


def test_an_architecture_without_pruning_support_is_refused_by_name(tmp_path):
    from lt_opd_ray.core.families import UnsupportedArchitectureError
    from lt_opd_ray.engines.vllm.engine import VLLMEngine

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}))
    with pytest.raises(UnsupportedArchitectureError, match="LlavaForConditionalGeneration"):
        VLLMEngine(tmp_path)


def test_a_glm_folder_without_its_attention_bias_flag_is_refused_by_name(tiny_dirs, tmp_path):
    """transformers builds GLM-4V's text q/k/v biases whatever the config says; vLLM builds them only when
    text_config.attention_bias is true (the releases set it). Without it vLLM would drop every bias and sample another
    model, so the engine refuses the folder before it starts."""
    import shutil

    from lt_opd_ray.core.families import UnsupportedArchitectureError
    from lt_opd_ray.engines.vllm.engine import check_architecture

    check_architecture(tiny_dirs["glm4v"])
    folder = Path(shutil.copytree(tiny_dirs["glm4v"], tmp_path / "glm"))
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["attention_bias"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="text_config.attention_bias is not true; transformers builds GLM-4.1V"):
        check_architecture(folder)


def test_selection_settings_are_validated_before_the_engine():
    from lt_opd_ray.engines.vllm.selection import MAX_QUERY_IDS, SelectionRequest

    vocab = 1000
    refused = {
        "lt_opd_selector": ("nope", "lt_opd_selector: unknown selector 'nope'"),
        "lt_opd_budget": (500, "unknown selection setting.*lt_opd_budget"),
        "lt_opd_budget_bps": (0, r"lt_opd_budget_bps: 0 is outside \[1, 10000\]"),
        "lt_opd_k_min": (True, "lt_opd_k_min: expected an integer, got bool"),
        "lt_opd_seed": (1.5, "lt_opd_seed: expected an integer, got float"),
        "lt_opd_nonce": (1 << 64, "lt_opd_nonce: .* is outside"),
    }
    for field, (value, message) in refused.items():
        with pytest.raises(ValueError, match=message):
            SelectionRequest.split({field: value}, vocab)
    for ids, message in (([3, vocab], r"lt_opd_query_ids\[1\]: 1000 is outside \[0, 999\]"), ([-1], r"query_ids\[0\]: -1 is outside"),
                         ([True], r"query_ids\[0\]: expected an integer, got bool"), ("12", "expected a list"),
                         ([1] * (MAX_QUERY_IDS + 1), f"at most {MAX_QUERY_IDS} token ids, got list of {MAX_QUERY_IDS + 1}")):
        with pytest.raises(ValueError, match=message):
            SelectionRequest.split({"lt_opd_query_ids": ids}, vocab)
    request, rest = SelectionRequest.split({"lt_opd_budget_bps": 500, "lt_opd_query_ids": [3, 999], "max_pixels": 10}, vocab)
    assert (request.budget_bps, request.query_ids, rest) == (500, (3, 999), {"max_pixels": 10})


@pytest.mark.slow
def test_an_image_beyond_max_pixels_is_resized_by_the_processor_rule_in_both_backends(tiny_dirs, engines):
    """Qwen's smart resize (sides in multiples of patch x merge, area within max_pixels) runs in both engines.

    Both give the image the same grid, so the same N and k; nothing is truncated. (vLLM keeps the
    resized pixels in uint8 and normalises inside the model: they differ from the transformers
    processor's by at most 1/255 in ~0.2% of the values, measured on this image.)
    """
    from conftest import random_image

    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.engines.vllm.engine import engine_prompt
    from lt_opd_ray.engines.vllm.selection import SelectionRequest
    from lt_opd_ray.models.processor import VLMProcessor, question_messages

    family = "qwen3_vl"
    processor = VLMProcessor(tiny_dirs[family])
    image = random_image(3, height=768, width=1024)  # 12x the tiny processor's max_pixels (256 x 256)
    prompt = processor.encode(question_messages("What is in the picture?"), [image])
    t, h, w = prompt.image_grid_thw[0].tolist()
    n = t * h * w // 4
    assert (h, w) == (12, 18) and h * w * 16 * 16 <= 256 * 256
    for budget_bps in (10000, BUDGET_BPS):
        selection = SelectionRequest(budget_bps=budget_bps, k_min=K_MIN, seed=1)
        (_, kept), = engines(family).generate([engine_prompt(prompt, [image])], [selection], GREEDY, seeds=[1])
        assert kept.indices[0].numel() == tokens_to_keep(n, budget_bps, K_MIN)
        assert int(kept.indices[0].max()) < n


@pytest.mark.slow
def test_the_jobs_pixel_bounds_resize_alike_in_both_backends(tiny_dirs):
    """data.min_pixels / max_pixels reach the transformers processor and vLLM's alike (here a quarter of the folder's)."""
    from conftest import random_image

    from lt_opd_ray.engines.vllm.engine import VLLMEngine, engine_prompt
    from lt_opd_ray.engines.vllm.selection import SelectionRequest
    from lt_opd_ray.models.processor import VLMProcessor, question_messages

    family, bounds = "qwen2_5_vl", (4096, 16384)
    processor = VLMProcessor(tiny_dirs[family], *bounds)
    image = random_image(4, height=768, width=1024)
    prompt = processor.encode(question_messages("What is in the picture?"), [image])
    t, h, w = prompt.image_grid_thw[0].tolist()
    assert h * w * 14 * 14 <= bounds[1] < 4 * h * w * 14 * 14
    engine = VLLMEngine(tiny_dirs[family], max_model_len=1024, min_pixels=bounds[0], max_pixels=bounds[1])
    (_, kept), = engine.generate([engine_prompt(prompt, [image])], [SelectionRequest(k_min=1)], GREEDY, seeds=[1])
    assert kept.indices[0].numel() == t * h * w // 4  # 100%: every one of the same N tokens


@pytest.mark.slow
def test_a_vllm_teacher_on_the_v1_runner_is_refused_at_a_real_vocabulary(tiny_dirs, tmp_path):
    """vLLM's CPU build (V1 runner) would return 248,320 prompt log-probs per scored row: refused at start, naming the fix.

    Last in this module: the engines it builds and drops reset vLLM's process-wide parallel state."""
    from conftest import job_for

    from lt_opd_ray.engines.vllm.engine import check_teacher_scoring
    from lt_opd_ray.engines.vllm.job import engine_for_job
    from lt_opd_ray.models.tiny import build_tiny_model

    real_vocab = build_tiny_model("qwen3_5", tmp_path / "real-vocab", vocab_size=248320)
    job = job_for(real_vocab, tmp_path, dtype="bfloat16", backend="vllm")
    with pytest.raises(ValueError, match=r"whole vocabulary \(248,320 ids\).*Set pools.teacher.backend: transformers"):
        engine_for_job(job, real_vocab, role="teacher")
    small = engine_for_job(job_for(tiny_dirs["qwen3_5"], tmp_path, dtype="bfloat16", backend="vllm"), tiny_dirs["qwen3_5"], role="teacher")
    assert not small.v2_runner
    check_teacher_scoring(small)  # a tiny vocabulary is fine on the V1 runner


def _merging_folder(tiny_dir, out):
    """A trained-looking token-merging student: the tiny model with a merge head whose weights are not its initial ones."""
    import shutil

    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.token_merge import merge_head

    shutil.copytree(tiny_dir, out)
    _, model = load_vlm(str(tiny_dir), "cpu", token_merge=True)
    torch.manual_seed(4)
    for parameter in merge_head(model).parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    model.save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_with_a_merge_head_vllm_equals_transformers_and_its_weights_follow_updates(family, tiny_dirs, tmp_path):
    """The plugin runs the folder's merge head after selection: the same routes and, with them, the same greedy
    tokens and log-probs as the transformers adapter; a weight update reaches the head (zero head: plain selection)."""
    from lt_opd_ray.engines.vllm.engine import VLLMEngine
    from lt_opd_ray.models.sampler import sample
    from lt_opd_ray.models.token_merge import assign_to_kept, merge_parameter_shapes

    folder = _merging_folder(tiny_dirs[family], tmp_path / "student")
    engine = VLLMEngine(folder, dtype="float32", max_model_len=1024)
    processor, prompts, engine_prompts = _prompts(folder)
    selections = _selections(len(prompts))
    vlm = _adapter(folder)
    results = engine.generate(engine_prompts, selections, GREEDY, seeds=[1, 2, 3])
    for prompt, (completion, kept) in zip(prompts, results):
        features = vlm.visual_features(prompt)
        assignment, prior = assign_to_kept(features.embeds[0], kept.indices[0])
        # the engine's vision features differ from transformers' by fp32 rounding (and more for Qwen2.5-VL, see LOGP_TOL)
        assert torch.equal(kept.merge_routes[0][0], assignment) and torch.allclose(kept.merge_routes[0][1], prior, atol=LOGP_TOL[family])
        merged = vlm.reduce(prompt, features, kept.indices, kept.merge_routes)
        assert not torch.allclose(merged.inputs_embeds, vlm.reduce(prompt, features, kept.indices, [(assignment, prior * 0)]).inputs_embeds)
        reference = sample(vlm, [merged], GREEDY, [0], processor.tokenizer)[0]
        assert completion.token_ids.tolist() == reference.token_ids.tolist()
        assert (completion.logprobs - reference.logprobs).abs().max() <= LOGP_TOL[family]
    dim = vlm.model.config.text_config.hidden_size
    engine.load_weights([(name, torch.zeros(shape)) for name, shape in merge_parameter_shapes(dim).items()])
    (completion, kept), = engine.generate(engine_prompts[:1], selections[:1], GREEDY, seeds=[1])
    plain = _adapter(tiny_dirs[family])  # the same base weights, no head
    features = plain.visual_features(prompts[0])
    reference = sample(plain, [plain.reduce(prompts[0], features, kept.indices)], GREEDY, [0], processor.tokenizer)[0]
    assert completion.token_ids.tolist() == reference.token_ids.tolist()
    assert (completion.logprobs - reference.logprobs).abs().max() <= LOGP_TOL[family]


# The model a shipped job names where that folder is not on this machine: the tiny model of its family.
STAND_INS = {"models/Qwen3.5-4B": "tiny:qwen3_5", "models/Qwen3.5-9B": "tiny:qwen3_5"}


def test_every_shipped_job_opens_its_vllm_engines_as_shipped(tiny_dirs):
    """Each role a shipped job runs on vLLM, opened by `engine_for_job` with the job as shipped (mode, backend, dtype,
    lengths, log-prob counts, tuning), on its own model or, where that folder is not here, the tiny model of its
    family: a job the schema passes is not refused when its pools start (the GRPO job's rollout workers once were).
    Engines whose arguments are equal are opened once."""
    import gc

    from lt_opd_ray.config.loading import load_job
    from lt_opd_ray.engines.vllm.job import engine_arguments, engine_for_job
    from lt_opd_ray.sources.resolve import resolve_model_dir

    repo = Path(__file__).resolve().parents[1]
    opened, roles = {}, []
    for path in sorted((repo / "jobs").glob("*.yaml")):
        job = load_job(path)
        for role in ("rollout", "teacher"):
            if getattr(job.pools, role).backend != "vllm":
                continue
            assert job.model.path in STAND_INS or job.model.path.startswith("tiny:"), f"{path.name}: give its model a stand-in"
            model_dir = resolve_model_dir(STAND_INS.get(job.model.path, job.model.path))
            roles.append(f"{path.name}:{role}")
            key = (role, str(model_dir), repr(engine_arguments(job, model_dir, role)))
            if key not in opened:
                engine = engine_for_job(job, model_dir, role)
                opened[key] = engine.runner
                del engine
                gc.collect()
    assert roles == ["train_qwen35.yaml:rollout", "train_qwen35_9b.yaml:rollout", "train_qwen35_grpo.yaml:rollout",
                     "train_tiny_vllm.yaml:rollout", "train_tiny_vllm.yaml:teacher"]
    print(f"\n{len(roles)} vLLM roles of the shipped jobs, {len(opened)} distinct engines opened")

