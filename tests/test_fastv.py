"""FastV: pruning inside the language model (core/selectors/fastv.py, models/lm_pruning.py), against its definition
computed another way: the scoring layer's attention from transformers' own eager kernel, and the layers after the cut
from a separate transformers language model of those layers alone, fed the kept tokens and run without a cache."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import FAMILIES, random_image

from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.selectors import SelectionInput, build_selector
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.sampler import SamplingParams, sample

DEPTH = {"qwen3_5": 8, "qwen3_vl": 4, "qwen2_5_vl": 4, "glm4v": 4}  # room after the scoring layer (Qwen3.5: layer 3)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """Per family: (QwenVLM, processor, folder) of a tiny model with layers after FastV's scoring layer."""
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import VLMProcessor
    from lt_opd_ray.models.tiny import build_tiny_model

    models = {}
    for family in FAMILIES:
        folder = build_tiny_model(family, tmp_path_factory.mktemp(family) / "model", seed=1, layers=DEPTH[family])
        if family == "qwen3_vl":  # three deepstack layers, as its releases: the third enters after FastV's cut
            from transformers import AutoConfig, AutoModelForImageTextToText

            config = AutoConfig.from_pretrained(folder)
            config.vision_config.depth, config.vision_config.deepstack_visual_indexes = 3, [0, 1, 2]
            torch.manual_seed(1)
            AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
        _, model = load_vlm(folder, device="cpu")
        models[family] = (QwenVLM(model.eval()), VLMProcessor(folder), folder)
    return models


def test_fastv_keeps_the_most_attended_tokens_ties_to_the_lower_index():
    fastv = build_selector("fastv")
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 40)
        scores = [rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(n)]  # ties on purpose
        k = rng.randint(1, n)
        item = SelectionInput(torch.zeros(n, 4), None, (1, n), language_attention=torch.tensor(scores))
        expected = sorted(sorted(range(n), key=lambda i: (-scores[i], i))[:k])
        assert fastv.select(item, k).tolist() == expected
    with pytest.raises(ValueError, match="fastv ranks by the language model's attention, which only a forward pruning inside it records"):
        fastv.select(SelectionInput(torch.zeros(3, 4), None, (1, 3)), 1)
    with pytest.raises(ValueError, match=r"language-model attention of shape \(2,\), features for 3 tokens"):
        fastv.select(SelectionInput(torch.zeros(3, 4), None, (1, 3), language_attention=torch.ones(2)), 1)


def _prompts(vlm, processor, selector, budget_bps):
    from lt_opd_ray.models.processor import encode_samples

    samples = [Sample("one", (random_image(1, 64, 96),), "what colour is it?"),
               Sample("two", (random_image(2, 96, 64), random_image(3, 64, 64)), "which one is bigger, the first or the second?")]
    prompts = encode_samples(processor, samples)
    return prompts, [vlm.reduced_prompt(p, vlm.visual_features(p), selector, budget_bps, 1) for p in prompts]


GREEDY = SamplingParams(max_new_tokens=5, greedy=True, top_k_logprobs=0, stop=(), eos_token_ids=())


@pytest.mark.parametrize("family", FAMILIES)
def test_fastv_keeping_every_token_is_the_plain_forward(family, deep):
    """A budget that keeps every visual token (k = N) through the two-range forward and its cache: the model's own
    forward, token for token and log-prob for log-prob, in a padded batch."""
    vlm, processor, _ = deep[family]
    with torch.no_grad():
        _, plain = _prompts(vlm, processor, None, 10_000)
        _, inside = _prompts(vlm, processor, build_selector("fastv"), 9_999)
        expected, got = sample(vlm, plain, GREEDY, [0, 0], processor.tokenizer), sample(vlm, inside, GREEDY, [0, 0], processor.tokenizer)
    for a, b, prompt in zip(expected, got, inside):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert [s.tolist() for s in b.selected] == [list(range(e.shape[0])) for e in prompt.inside.features.embeds]


def _late_model(vlm: QwenVLM, cut: int):
    """A transformers language model of the layers [cut, N) alone (its own config, its own layer indices), the
    original's weights."""
    text = vlm.language_model
    config = copy.deepcopy(text.config)
    layers = config.num_hidden_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[cut:]
    config.num_hidden_layers = layers - cut
    late = type(text)(config).eval()
    state = {}
    for name, tensor in text.state_dict().items():
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            if int(index) >= cut:
                state[f"layers.{int(index) - cut}.{rest}"] = tensor
        elif not name.startswith("embed_tokens"):
            state[name] = tensor
    missing, unexpected = late.load_state_dict(state, strict=False)
    assert not unexpected and all(m.startswith("embed_tokens") for m in missing), (missing, unexpected)
    return late


def _reference(vlm: QwenVLM, prompt, budget_bps: int, response: list[int], scoring: int):
    """FastV read plainly, one prompt, no cache: the full sequence (prompt and `response`) through transformers' own
    language model under eager attention; the scoring layer's attention weights of the last prompt token (its own
    kernel's, heads averaged) rank each image's tokens, top k with ties to the lower index; the hidden states after
    the scoring layer (deepstack added where the model adds it), cut to the text, the kept visual tokens and the
    response, at their own positions, go through `_late_model`. Returns (kept per unit, log-probs of the response's
    tokens) ."""
    from lt_opd_ray.core.curriculum import tokens_to_keep

    text = vlm.language_model
    seen = {}
    def keep(name, value):
        seen[name] = value  # returns None: the module's output stands

    handles = [text.layers[scoring].self_attn.register_forward_hook(lambda m, args, out: keep("weights", out[1])),
               text.layers[scoring].register_forward_hook(lambda m, args, out: keep("hidden", out))]
    ids = torch.tensor(response[:-1], dtype=torch.long)
    full = prompt.inside
    reduced = vlm.reduce(full.prompt, full.features, vlm.keep_all(full.features))
    vlm.model.set_attn_implementation("eager")
    try:
        batch = vlm.pad_batch([reduced], [ids])
        vlm.run_language_model(batch)
    finally:
        vlm.model.set_attn_implementation("sdpa")
        for handle in handles:
            handle.remove()
    length = reduced.length
    attention = seen["weights"][0, :, length - 1, :length].mean(0)  # the last prompt token's row
    visual = batch.visual_pos_masks[0].nonzero().flatten().tolist()
    sizes = [embeds.shape[0] for embeds in full.features.embeds]
    if full.selector.scope == "prompt":  # the release's ranking: every visual token of the prompt against every other
        scores = [float(attention[column]) for column in visual]
        chosen = sorted(range(len(visual)), key=lambda i: (-scores[i], i))[: tokens_to_keep(len(visual), budget_bps, full.k_min)]
        kept = [sorted(i - start for i in chosen if start <= i < start + n) for start, n in zip(_starts(full.features.embeds), sizes)]
    else:
        kept = []
        for start, n in zip(_starts(full.features.embeds), sizes):
            scores = [float(attention[visual[start + i]]) for i in range(n)]
            kept.append(sorted(sorted(range(n), key=lambda i: (-scores[i], i))[: tokens_to_keep(n, budget_bps, full.k_min)]))
    hidden = seen["hidden"][0]
    if batch.deepstack is not None and scoring < len(batch.deepstack):
        hidden = hidden.clone()
        hidden[batch.visual_pos_masks[0]] += batch.deepstack[scoring]
    kept_columns = ~batch.visual_pos_masks[0].clone()
    kept_columns[[visual[start + i] for start, unit in zip(_starts(full.features.embeds), kept) for i in unit]] = True
    columns = kept_columns.nonzero().flatten()
    positions = torch.cat([torch.arange(columns.numel())[None], batch.position_ids[1:, 0, columns]])[:, None]
    late, cut = _late_model(vlm, scoring + 1), scoring + 1
    deepstack = {}
    if batch.deepstack is not None and len(batch.deepstack) > cut:  # the layers after the cut add it at the kept tokens
        kept_visual = kept_columns[batch.visual_pos_masks[0]]
        deepstack = {"visual_pos_masks": batch.visual_pos_masks[0][columns][None],
                     "deepstack_visual_embeds": [layer[kept_visual] for layer in batch.deepstack[cut:]]}
    out = late(inputs_embeds=hidden[columns][None], position_ids=positions, use_cache=False, **deepstack).last_hidden_state
    log_probs = torch.log_softmax(vlm.lm_head(out[0]).float(), dim=-1)
    predicted = log_probs[-len(response):]  # the last prompt token and each response token but the last predict the next
    return kept, predicted.gather(-1, torch.tensor(response)[:, None])[:, 0], predicted.argmax(-1).tolist()


def _starts(embeds):
    starts, start = [], 0
    for e in embeds:
        starts.append(start)
        start += e.shape[0]
    return starts


@pytest.mark.parametrize(("family", "scope"), [(f, "image") for f in FAMILIES] + [("qwen3_vl", "prompt")])
def test_fastv_equals_its_definition_read_plainly(family, scope, deep):
    """At 25% of each image's tokens (scope image), or of the prompt's (scope prompt: the release's ranking across its
    images), in a padded batch of a one-image and a two-image prompt: the tokens kept are the eager attention's top k,
    and every greedy token and its log-prob equal the plain reading's (the later layers as their own model over the
    kept tokens, no cache)."""
    from lt_opd_ray.core.fastv_layers import scoring_layer

    vlm, processor, _ = deep[family]
    scoring = scoring_layer(vlm.language_model.config)
    assert scoring == (3 if family == "qwen3_5" else 1)  # Qwen3.5: its first full-attention layer
    with torch.no_grad():
        _, prompts = _prompts(vlm, processor, build_selector("fastv", scope), 2_500)
        completions = sample(vlm, prompts, GREEDY, [0, 0], processor.tokenizer)
        for prompt, completion in zip(prompts, completions):
            kept, logprobs, greedy = _reference(vlm, prompt, 2_500, completion.token_ids.tolist(), scoring)
            assert [s.tolist() for s in completion.selected] == kept
            assert completion.token_ids.tolist() == greedy
            torch.testing.assert_close(completion.logprobs, logprobs, rtol=0, atol=1e-4)


def test_fastv_is_refused_where_nothing_follows_its_scoring_layer_and_on_vllm(tiny_dirs, tmp_path):
    import shutil

    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.core.families import UnsupportedArchitectureError
    from lt_opd_ray.engines.vllm.selection import SelectionRequest
    from lt_opd_ray.core.fastv_layers import scoring_layer
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.serving.serve import serve_command

    _, model = load_vlm(tiny_dirs["qwen3_vl"], device="cpu")  # two layers: the scoring layer is the last
    with pytest.raises(ValueError, match=r"fastv: the language model has 2 layers and FastV ranks at layer 1 \(0-based\)"):
        scoring_layer(QwenVLM(model).language_model.config)
    with pytest.raises(ValueError, match="lt_opd_selector: fastv prunes inside the language model, which vLLM's model runner does not"):
        SelectionRequest.split({"lt_opd_selector": "fastv"}, vocab_size=100)
    folder = tmp_path / "student"
    shutil.copytree(tiny_dirs["qwen3_vl"], folder)
    CompressionConfig("fastv", 500, 1).write(folder)
    with pytest.raises(UnsupportedArchitectureError, match="its selector fastv prunes inside the language model"):
        serve_command(folder, engine="vllm")
    argv, _ = serve_command(folder)  # auto: the transformers engine
    assert "lt_opd_ray.serving.transformers_server" in argv


def test_lt_opd_eval_refuses_fastv_on_a_model_without_room_before_any_benchmark(tiny_dirs, tmp_path, capsys):
    from test_benchmarks import fixture

    from lt_opd_ray.cli.main import main

    pope, _, _ = fixture("pope", tmp_path)
    argv = ["eval", str(tiny_dirs["qwen3_vl"]), "--bench", f"pope={pope}", "--selectors", "cdpruner", "fastv", "--out", str(tmp_path / "eval")]
    assert main(argv) == 2
    assert "fastv: the language model has 2 layers and FastV ranks at layer 1" in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()


def test_efficiency_counts_fastv_where_the_model_has_room_for_it(tiny_dirs, tmp_path, capsys):
    import shutil

    from lt_opd_ray.cli.main import main
    from lt_opd_ray.core.compression import CompressionConfig

    assert main(["efficiency", str(tiny_dirs["qwen3_vl"]), "--fastv"]) == 2
    assert "efficiency: fastv: the language model has 2 layers and FastV ranks at layer 1" in capsys.readouterr().err
    shutil.copytree(tiny_dirs["qwen3_vl"], tmp_path / "student")
    CompressionConfig("fastv", 500, 1).write(tmp_path / "student")
    assert main(["efficiency", str(tmp_path / "student")]) == 2  # the folder's selector: FastV's count without --fastv
    assert "efficiency: fastv: the language model has 2 layers" in capsys.readouterr().err
    assert main(["efficiency", "--preset", "qwen3.5-4b", "--fastv", "--budgets", "500"]) == 0
    out = capsys.readouterr().out
    assert "pruned inside the language model as FastV does, after layer 3 (0-based)" in out
    assert "     5%     812      1.509 (-74.6%)          2.641   6.80 (-74.5%)         51.90" in out  # docs/commands.md's row


def test_the_probe_reads_four_dimensional_masks_and_refuses_others():
    from lt_opd_ray.models.lm_pruning import last_query_attention

    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[0, :, :, :2] = False  # row 0 left-padded by two
    got = last_query_attention(q, k, mask, None)
    for b in range(2):  # by hand: each head against its key head (GQA: heads 0-1 read key head 0), masked, averaged
        keys = range(2, 5) if b == 0 else range(5)
        summed = torch.zeros(5)
        for h in range(4):
            logits = torch.stack([(q[b, h, -1] * k[b, h // 2, j]).sum() / 8**0.5 for j in keys])
            summed[list(keys)] += torch.softmax(logits, 0)
        torch.testing.assert_close(got[b], summed / 4)
    with pytest.raises(ValueError, match="fastv's probe reads a .B, 1, queries, keys. attention mask .sdpa, eager.; this attention implementation hands it a 2-D one"):
        last_query_attention(q, k, mask[:, 0, -1], None)


def test_fastv_is_refused_beside_a_learnable_token_merge():
    from lt_opd_ray.config.loading import load_job
    from lt_opd_ray.config.schema import JobConfig

    job = load_job("jobs/train_tiny.yaml").model_dump()
    job["eval"].update(data="synthetic:4", selectors=["cdpruner", "fastv"])
    JobConfig.model_validate(job)  # beside no merge: evaluated
    job["selector"]["merge"] = "learnable"
    with pytest.raises(ValueError, match="eval.selectors fastv prunes inside the language model, where selector.merge learnable has no discarded"):
        JobConfig.model_validate(job)


def test_the_transformers_server_answers_with_fastv(deep, tmp_path):
    """A FastV folder served by the transformers engine (an HTTP request) answers what `lt-opd eval`'s path answers."""
    import base64
    import io
    import shutil

    from starlette.testclient import TestClient

    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.models.evaluation import generate_responses
    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.transformers_server import TransformersStudent, build_app

    vlm, processor, model_folder = deep["qwen2_5_vl"]
    folder = tmp_path / "student"
    shutil.copytree(model_folder, folder)
    CompressionConfig("fastv", 2_500, 1).write(folder)
    client = TestClient(build_app(TransformersStudent(folder), None, ServeLimits()))
    image = random_image(1, 64, 96)
    png = io.BytesIO()
    image.save(png, format="PNG")
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
        {"type": "text", "text": "what colour is it?"}]}], "max_tokens": 5, "temperature": 0}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    (expected,) = generate_responses(vlm, processor, [Sample("x", (image,), "what colour is it?")], 2_500, "fastv", max_new_tokens=5)
    assert answer.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_the_calculator_counts_what_fastvs_prefill_computes_and_caches(family, deep):
    """`prefill_cost(..., pruned_after=fastv_cut)`: the matrix products torch counts in the two-range prefill (eager
    attention as matmuls; Qwen3.5's reference chunked kernel pads to 64-token chunks, so it counts more there) and
    the bytes its cache holds, each layer at its own length."""
    import json

    from torch.utils.flop_counter import FlopCounterMode

    from lt_opd_ray.models.lm_pruning import PrunedInside
    from lt_opd_ray.planning.efficiency import fastv_cut, prefill_cost

    vlm, processor, folder = deep[family]
    config = json.loads((folder / "config.json").read_text())
    prompts, (reduced, _) = _prompts(vlm, processor, build_selector("fastv"), 2_500)
    grid = tuple(prompts[0].image_grid_thw[0].tolist())
    visual = int(reduced.visual_mask.sum())
    vlm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counted:
            decoding = PrunedInside(vlm, [reduced])
            decoding.prefill()
    finally:
        vlm.model.set_attn_implementation("sdpa")
    cost = prefill_cost(config, reduced.length - visual, [grid], 2_500, 1, dtype_bytes=4, state_dtype_bytes=4, pruned_after=fastv_cut(config))
    assert cost.prefill_tokens == reduced.length and cost.visual_tokens == sum(s.numel() for s in decoding.selected[0])
    if family != "qwen3_5":
        assert counted.get_total_flops() == cost.lm_flops
    else:
        assert counted.get_total_flops() > cost.lm_flops
    kv = sum(t.numel() * t.element_size() for layer in decoding.cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
             if isinstance(t, torch.Tensor))
    assert kv == cost.kv_cache_bytes


def test_validate_names_a_model_with_no_room_for_fastv_among_the_eval_selectors(tiny_dirs, tmp_path, capsys):
    """`eval.selectors: [fastv]` on a model whose last layer is FastV's scoring layer is named before anything trains."""
    from lt_opd_ray.cli.main import main

    job = tmp_path / "job.yaml"
    job.write_text(open("jobs/train_tiny.yaml").read())
    sets = [f"model.path={tiny_dirs['qwen3_vl']}", "eval.data=synthetic:4", "eval.selectors=['cdpruner','fastv']"]
    assert main(["validate", str(job), *(f"--set={s}" for s in sets)]) == 1
    assert (f"eval.selectors fastv on model.path '{tiny_dirs['qwen3_vl']}' ({tiny_dirs['qwen3_vl'] / 'config.json'}): fastv: the"
            " language model has 2 layers and FastV ranks at layer 1") in capsys.readouterr().err
    assert main(["validate", str(job), *(f"--set={s}" for s in sets[1:])]) == 0  # the embedded model: built and checked by train
