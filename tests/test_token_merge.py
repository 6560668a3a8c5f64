"""Learnable token merging (models/token_merge.py): the assignment, the prior and the merged tokens against a
brute-force reference written from the definition; plain selection at initialisation, bit for bit; gradients;
the release's folder layout; the job setting."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import job_for, random_image

from lt_opd_ray.config.loading import JobConfigError, parse_job
from lt_opd_ray.core.optim import param_groups
from lt_opd_ray.core.selectors import build_selector
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.loading import load_vlm
from lt_opd_ray.models.processor import VLMProcessor, question_messages
from lt_opd_ray.models.token_merge import HIDDEN, LearnableMerge, assign_to_kept, merge_head, settings
from lt_opd_ray.sources.resolve import resolve_model_dir


def brute_force_route(x: torch.Tensor, kept: list[int]) -> tuple[list[int], list[float]]:
    """Nearest kept token by cosine (ties: first in original order), then a softmax over each group's discarded tokens."""
    unit = [row / row.double().norm() for row in x.double()]
    slots = []
    for i in range(len(unit)):
        if i in kept:
            slots.append(kept.index(i))
            continue
        cosines = [max(-1.0, min(1.0, float(unit[i] @ unit[s]))) for s in kept]
        slots.append(cosines.index(max(cosines)))
    prior = [0.0] * len(unit)
    for slot in range(len(kept)):
        members = [i for i in range(len(unit)) if slots[i] == slot and i not in kept]
        exps = [math.exp(float(unit[i] @ unit[kept[slot]])) for i in members]
        for i, e in zip(members, exps):
            prior[i] = e / sum(exps)
    return slots, prior


def brute_force_merge(x: torch.Tensor, kept: list[int], head: LearnableMerge) -> torch.Tensor:
    """y_k = x_{s_k} + sum over the discarded tokens i of group k of p_i tanh(delta_i) (x_i - x_{s_k}), token by token."""
    slots, prior = brute_force_route(x, kept)
    a_half, b_half = head.input.weight[:, : head.dim], head.input.weight[:, head.dim :]

    def layer_norm(v):
        return (v - v.mean()) / torch.sqrt(v.var(unbiased=False) + head.norm.eps)

    out = []
    for slot, s in enumerate(kept):
        y = x[s].clone()
        for i in range(x.shape[0]):
            if slots[i] != slot or i in kept:
                continue
            delta = head.output.weight[0] @ torch.nn.functional.silu(a_half @ layer_norm(x[i]) + head.input.bias + b_half @ layer_norm(x[s]))
            y = y + prior[i] * torch.tanh(delta) * (x[i] - x[s])
        out.append(y)
    return torch.stack(out)


def test_the_route_equals_a_brute_force_nearest_kept_search_with_ties_to_the_first():
    torch.manual_seed(0)
    x = torch.randn(60, 16)
    x[7] = x[3] * 2.0  # tokens 3 and 7 are both kept and point the same way: every tie goes to slot of 3
    x[41] = x[3] + x[3].norm() * 1e-9
    kept = [3, 7, 20, 33, 50]
    assignment, prior = assign_to_kept(x, torch.tensor(kept))
    slots, expected_prior = brute_force_route(x, kept)
    assert assignment.tolist() == slots and assignment[41] == 0
    assert torch.allclose(prior, torch.tensor(expected_prior, dtype=torch.float32), atol=1e-6)
    assert all(prior[k] == 0 for k in kept)
    sums = torch.zeros(len(kept)).index_add(0, assignment, prior)  # each group's discarded priors sum to 1 (0 for a lone anchor)
    assert torch.allclose(sums, torch.tensor([float(any(s == k and i not in kept for i, s in enumerate(slots))) for k in range(len(kept))]))


def test_merged_tokens_and_their_gradients_equal_the_token_by_token_definition():
    torch.manual_seed(1)
    head = LearnableMerge(16)
    head.initialize_from_gate(torch.randn(200, 16))
    torch.nn.init.normal_(head.output.weight, std=0.5)  # a trained head: residual weights are not zero
    x = torch.randn(50, 16, requires_grad=True)
    kept = [2, 9, 30, 44]
    route = assign_to_kept(x, torch.tensor(kept))
    ours = head(x, torch.tensor(kept), route)
    reference = brute_force_merge(x, kept, head)
    assert torch.allclose(ours, reference, atol=1e-5) and not torch.allclose(ours, x[kept], atol=1e-3)
    probe = torch.randn_like(ours)
    ours_grads = torch.autograd.grad((ours * probe).sum(), [x, *head.parameters()])
    reference_grads = torch.autograd.grad((reference * probe).sum(), [x, *head.parameters()])
    for got, want in zip(ours_grads, reference_grads):
        assert torch.allclose(got, want, atol=1e-5)
    # the head learns only through discarded tokens: with every token kept it gets no gradient
    everything = torch.arange(50)
    whole = head(x, everything, assign_to_kept(x, everything))
    assert torch.equal(whole, x) and not whole.grad_fn.name().startswith("IndexAdd")


def test_the_head_starts_from_evenly_spaced_gate_rows_and_a_zero_output_layer():
    gate = torch.randn(300, 16)
    head = LearnableMerge(16)
    picked = head.initialize_from_gate(gate)
    assert picked[0] == 0 and picked[-1] == 299 and len(picked) == HIDDEN and picked == sorted(set(picked))
    rows = gate[picked] / gate[picked].norm(dim=1, keepdim=True) / math.sqrt(2)
    assert torch.allclose(head.input.weight[:, :16], rows) and torch.equal(head.input.weight[:, :16], head.input.weight[:, 16:])
    assert not head.input.bias.any() and not head.output.weight.any()


@pytest.fixture(scope="module")
def prompt_and_models(tiny_dirs):
    plain = QwenVLM(load_vlm(str(tiny_dirs["qwen3_5"]), "cpu")[1].eval())
    merging = QwenVLM(load_vlm(str(tiny_dirs["qwen3_5"]), "cpu", token_merge=True)[1].eval())
    processor = VLMProcessor(tiny_dirs["qwen3_5"])
    prompt = processor.encode(question_messages("How many dots?"), [random_image(3, 96, 128)])
    return plain, merging, prompt


def test_at_initialisation_the_merging_student_equals_plain_selection_bit_for_bit(prompt_and_models):
    plain, merging, prompt = prompt_and_models
    gate = merging.model.model.language_model.layers[0].mlp.gate_proj.weight
    assert merging.model.config.vision_token_compressor == settings(gate.shape[1])
    with torch.no_grad():
        features = [vlm.visual_features(prompt) for vlm in (plain, merging)]
        kept = plain.select(prompt, features[0], build_selector("cdpruner"), 1000, 2)
        reduced = [vlm.reduce(prompt, f, kept) for vlm, f in zip((plain, merging), features)]
        assert torch.equal(reduced[0].inputs_embeds, reduced[1].inputs_embeds) and reduced[0].merge_routes is None
        logits = [vlm.model.lm_head(vlm.response_hidden([r], [torch.tensor([5, 6, 7])])[0]) for vlm, r in zip((plain, merging), reduced)]
    assert torch.equal(logits[0], logits[1])
    assignment, prior = reduced[1].merge_routes[0]
    assert assignment.shape == (features[0].embeds[0].shape[0],) and float(prior.sum()) > 0


def test_a_folder_in_the_release_layout_loads_with_its_trained_head(prompt_and_models, tiny_dirs, tmp_path, capsys):
    """The release's export: one model.safetensors holding the base weights and the head's three fp32 tensors,
    config.json with `vision_token_compressor`, and visual_compression_config.json beside it."""
    from safetensors.torch import load_file, save_file

    plain, _, prompt = prompt_and_models
    _, model = load_vlm(str(tiny_dirs["qwen3_5"]), "cpu")
    model.save_pretrained(tmp_path / "release")
    dim = model.config.text_config.hidden_size
    torch.manual_seed(2)
    trained = {"model.vision_token_compressor.learnable_summary.input.weight": torch.randn(HIDDEN, 2 * dim),
               "model.vision_token_compressor.learnable_summary.input.bias": torch.randn(HIDDEN),
               "model.vision_token_compressor.learnable_summary.output.weight": torch.randn(1, HIDDEN)}
    weights = load_file(tmp_path / "release" / "model.safetensors") | trained
    save_file(weights, str(tmp_path / "release" / "model.safetensors"), metadata={"format": "pt"})
    compressor = {"enabled": True, "algorithm": "qwen35_cdpruner_v1", "method": "cdpruner", "retention_ratio": 0.05,
                  "minimum_tokens_per_image": 32, "reduction": "differentiable_fp32_zero_init_signed_residual",
                  "route_schema_version": "vision_opd_cdpruner_learnable_merge_zero_residual_curriculum_route_v1",
                  "summary": {"enabled": False}, "curriculum": {"enabled": True, "final_retention_bps": 500},
                  "learnable_merge": {"enabled": True, "aggregation": "zero_init_signed_residual_v1",
                                      "initialization": "pretrained_mlp_gate_rows_zero_output_v1", "input_hidden_size": dim,
                                      "hidden_size": 64, "temperature": 1.0, "assignment": "cosine_nearest_retained_original_index_tie",
                                      "activation_checkpointing": True, "chunk_tokens": 1024}}
    config = json.loads((tmp_path / "release" / "config.json").read_text()) | {"vision_token_compressor": compressor}
    (tmp_path / "release" / "config.json").write_text(json.dumps(config))
    (tmp_path / "release" / "visual_compression_config.json").write_text(json.dumps({"attn_implementation": "flash_attention_2", "vision_token_compressor": compressor}))
    _, loaded = load_vlm(str(tmp_path / "release"), "cpu")
    head = merge_head(loaded)
    assert head is not None and all(torch.equal(p, trained[f"model.vision_token_compressor.{n}"]) for n, p in loaded.model.vision_token_compressor.named_parameters())
    release = QwenVLM(loaded.eval())
    with torch.no_grad():
        features = release.visual_features(prompt)
        kept = release.select(prompt, features, build_selector("cdpruner"), 1000, 2)
        merged = release.reduce(prompt, features, kept).inputs_embeds
        pruned = plain.reduce(prompt, plain.visual_features(prompt), kept).inputs_embeds
    assert merged.shape == pruned.shape and not torch.allclose(merged, pruned)  # same tokens, the trained head moved them
    # served and trained as the release says: CDPruner at its final 5%, at least 32 tokens, the merge on
    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.runtime.preflight import check_token_merge
    from lt_opd_ray.serving.serve import serve_command

    assert CompressionConfig.read(tmp_path / "release") == CompressionConfig("cdpruner", 500, 32, "learnable")
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja"):
        if (tiny_dirs["qwen3_5"] / name).exists():
            (tmp_path / "release" / name).write_bytes((tiny_dirs["qwen3_5"] / name).read_bytes())
    capsys.readouterr()
    serve_command(tmp_path / "release")
    assert "with cdpruner at 5% (k_min 32), kept tokens merged with their discarded neighbours" in capsys.readouterr().out
    job = job_for(str(tmp_path / "release"), tmp_path / "run")
    with pytest.raises(ValueError, match="holds a student with a learnable token merge: set selector.merge: learnable"):
        check_token_merge(job, tmp_path / "release")
    check_token_merge(job.model_copy(update={"selector": job.selector.model_copy(update={"merge": "learnable"})}), tmp_path / "release")
    compressor["learnable_merge"]["aggregation"] = "something_else"
    config["vision_token_compressor"] = compressor
    (tmp_path / "release" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="learnable_merge.aggregation is 'something_else'; this runtime implements 'zero_init_signed_residual_v1'"):
        load_vlm(str(tmp_path / "release"), "cpu")


def test_the_job_setting_its_learning_rate_and_backends():
    job = job_for("tiny:qwen3_5", "/tmp/unused", extra="selector: {merge: learnable}\n")
    assert job.selector.merge == "learnable" and job.optimizer.lr.token_merge == 1e-4
    _, model = load_vlm(resolve_model_dir("tiny:qwen3_5"), "cpu", token_merge=True)
    groups = {g["name"]: g for g in param_groups(model, job.optimizer.lr)}
    assert groups["token_merge"]["lr"] == 1e-4 and len(groups["token_merge"]["params"]) == 3
    with pytest.raises(JobConfigError, match="merge"):
        parse_job("name: x\nmodel: {path: 'tiny:qwen3_5'}\ndata: {path: 'synthetic:4'}\nselector: {merge: mean}\n")


def test_a_merging_student_saves_its_head_and_config_and_loads_back(tmp_path):
    """What `lt-opd export` and the learners' final/ write: the head under the release's names, config.json naming it."""
    from lt_opd_ray.serving.serve import serve_command

    _, model = load_vlm(resolve_model_dir("tiny:qwen3_5"), "cpu", token_merge=True)
    torch.nn.init.normal_(merge_head(model).output.weight)  # as after training
    model.save_pretrained(tmp_path / "student")
    _, back = load_vlm(str(tmp_path / "student"), "cpu")
    assert json.loads((tmp_path / "student" / "config.json").read_text())["vision_token_compressor"]["learnable_merge"]["enabled"]
    assert all(torch.equal(a, b) for a, b in zip(merge_head(model).parameters(), merge_head(back).parameters()))
    argv, _ = serve_command(tmp_path / "student")  # served with its head (the vLLM plugin runs it: test_vllm_engine)
    assert argv[argv.index("--model") + 1] == str((tmp_path / "student").resolve())


def test_the_analytic_merge_flops_and_parameters_count_what_the_module_runs():
    from torch.utils.flop_counter import FlopCounterMode

    from lt_opd_ray.planning.efficiency import merge_flops, merge_parameters
    from lt_opd_ray.planning.presets import PRESETS

    config = {"text_config": {"hidden_size": 48}}
    head = LearnableMerge(48)
    head.initialize_from_gate(torch.randn(100, 48))
    x, kept = torch.randn(3000, 48), torch.arange(0, 3000, 20)  # more rows than one assignment chunk
    with FlopCounterMode(display=False) as counter:
        head(x, kept, assign_to_kept(x, kept))
    assert counter.get_total_flops() == merge_flops(config, 3000, kept.numel())
    assert merge_parameters(config) == sum(p.numel() for p in head.parameters())
    assert merge_parameters(PRESETS["qwen3.5-4b"]) == 327_808  # D = 2560
