"""Analytic prefill FLOPs and cache bytes against what the tiny real models do.

FLOPs are measured two ways: forward hooks on every nn.Linear / nn.Conv3d (the
projections), and torch's FlopCounterMode over the whole forward with eager
attention (every matmul, attention included). Cache bytes are the sizes of the
tensors in the model's own cache after a prefill.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import FAMILIES, random_image
from torch.utils.flop_counter import FlopCounterMode

from lt_opd_ray.planning.efficiency import lm_projection_flops_per_token, prefill_cost, vision_projection_flops
from lt_opd_ray.planning.presets import QWEN35_4B

BUDGET_BPS, K_MIN = 2500, 2


def _projection_flops(modules) -> tuple[dict, list]:
    counted = {"flops": 0}

    def hook(module, inputs, output):
        if isinstance(module, torch.nn.Linear):
            rows = inputs[0].numel() // inputs[0].shape[-1]
            counted["flops"] += 2 * module.in_features * module.out_features * rows
        else:  # the Conv3d patch embedding; GLM-4V's Conv2d downsample
            counted["flops"] += 2 * output.numel() * module.in_channels * math.prod(module.kernel_size)

    handles = [m.register_forward_hook(hook) for m in modules if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d, torch.nn.Conv2d))]
    return counted, handles


def _tensors(states) -> list:
    """The tensors of a cache layer's per-state container (a dict or list keyed by state index)."""
    values = states.values() if isinstance(states, dict) else (states or [])
    return [t for t in values if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("family", FAMILIES)
def test_analytic_costs_equal_the_counted_flops_and_the_real_cache(family, tiny_dirs):
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.processor import VLMProcessor, question_messages

    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs[family], dtype=torch.float32).eval()
    model.set_attn_implementation("eager")  # attention as matmuls, which FlopCounterMode counts
    config = json.loads((tiny_dirs[family] / "config.json").read_text())
    vlm, processor = QwenVLM(model), VLMProcessor(tiny_dirs[family])
    prompt = processor.encode(question_messages("What is in the picture?"), [random_image(0, 160, 224)])
    grid = tuple(prompt.image_grid_thw[0].tolist())

    language, lm_hooks = _projection_flops(model.model.language_model.modules())
    vision, vision_hooks = _projection_flops(model.model.visual.modules())
    with torch.no_grad():
        with FlopCounterMode(display=False) as vision_counter:
            features = vlm.visual_features(prompt)
        kept = vlm.select(prompt, features, build_selector("cdpruner"), BUDGET_BPS, K_MIN)
        reduced = vlm.reduce(prompt, features, kept)
        with FlopCounterMode(display=False) as lm_counter:
            _, cache = vlm.run_language_model(vlm.pad_batch([reduced]), use_cache=True)
    for handle in lm_hooks + vision_hooks:
        handle.remove()

    cost = prefill_cost(config, reduced.length - kept[0].numel(), [grid], BUDGET_BPS, K_MIN, dtype_bytes=4, state_dtype_bytes=4)
    assert cost.prefill_tokens == reduced.length
    assert language["flops"] == lm_projection_flops_per_token(config) * reduced.length
    assert vision["flops"] == vision_projection_flops(config, grid)
    assert vision_counter.get_total_flops() == cost.vision_flops  # + every block's attention (Qwen2.5-VL: windows)
    if family != "qwen3_5":  # all full attention: projections + 4 L^2 H d per layer is every counted matmul
        assert lm_counter.get_total_flops() == cost.lm_flops
    else:  # the reference chunked GDN kernel pads to 64-token chunks: more counted work than the recurrent form
        assert lm_counter.get_total_flops() > cost.lm_flops

    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))
    states = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for name in ("conv_states", "recurrent_states")
        for t in _tensors(getattr(layer, name, None))
    )
    assert (kv, states) == (cost.kv_cache_bytes, cost.linear_state_bytes)


def test_qwen35_4b_preset_reproduces_the_papers_cache_and_prefill_reduction():
    """84 text tokens and an 896 x 832 image (728 visual tokens): the layout the paper's KV figure implies."""
    full = prefill_cost(QWEN35_4B, 84, [(1, 56, 52)], 10000, 1)
    low = prefill_cost(QWEN35_4B, 84, [(1, 56, 52)], 500, 1)
    assert (full.prefill_tokens, low.prefill_tokens) == (812, 121)
    assert full.kv_cache_bytes / 1e6 == pytest.approx(26.59, rel=0.01) and low.kv_cache_bytes / 1e6 == pytest.approx(3.93, rel=0.01)
    assert full.lm_flops / 1e12 == pytest.approx(6.002, rel=0.02) and low.lm_flops / 1e12 == pytest.approx(0.878, rel=0.02)
    assert low.linear_state_bytes == full.linear_state_bytes and low.vision_flops == full.vision_flops


def test_efficiency_command_prints_the_reduction_table(capsys):
    from lt_opd_ray.cli.main import main

    assert main(["efficiency", "--preset", "qwen3.5-4b", "--budgets", "500"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "728 visual tokens" in lines[0]
    assert lines[-1].split()[:3] == ["5%", "121", "0.875"] and "-85.3%" in lines[-1]
    assert main(["efficiency", "--preset", "qwen3.5-4b", "--image", "big"]) == 2
    # four images, each pruned on its own: 4 x 182 visual tokens of a 448 x 448 image, 4 x 10 kept at 5%
    assert main(["efficiency", "--preset", "qwen3.5-4b", "--image", "448x416", "--images", "4", "--budgets", "500"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "4 images of 448x416, each pruned to the budget (728 visual tokens)" in lines[0]
    assert lines[-1].split()[:2] == ["5%", str(84 + 4 * 10)]
    assert main(["efficiency", "--preset", "qwen3.5-4b", "--images", "0"]) == 2
    # a 16-frame clip: 8 temporal patches of 182 tokens, each pruned on its own (10 kept at 5%), 8 timestamps of 8 tokens
    assert main(["efficiency", "--preset", "qwen3.5-4b", "--image", "448x416", "--frames", "16", "--budgets", "500"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "a 16-frame clip of 448x416 frames (8 temporal patches" in lines[0] and "(1456 visual tokens)" in lines[0]
    assert lines[1 + 1].split()[:2] == ["100%", str(84 + 8 * 8 + 1456)] and lines[-1].split()[:2] == ["5%", str(84 + 8 * 8 + 8 * 10)]
    assert main(["efficiency", "--preset", "qwen3.5-4b", "--frames", "15"]) == 2  # two frames make one temporal patch


def test_commands_without_their_input_are_refused_in_one_line(capsys):
    from lt_opd_ray.cli.main import main

    assert main(["efficiency"]) == 2
    assert "give a model folder or --preset (one of qwen3.5-4b, qwen3.5-9b, glm-4.6v-flash)" in capsys.readouterr().err
    assert main(["ablation", "jobs/toy_circles.yaml", "--arms", "nope"]) == 2
    assert "unknown arm(s) nope; known:" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["transformers", "vLLM"])
def test_the_measured_mode_times_the_serving_engine_beside_the_calculators_prediction(engine, tiny_dirs, tmp_path, capsys):
    """`--measure` on the engine `lt-opd serve` picks: the toy student (head size 16) on transformers, a tiny Qwen3-VL
    on vLLM's CPU build. The prompt it prefilled at each budget is the calculator's for the same prompt, fewer at 5%;
    its first-token and end-to-end figures are positive times. Timings themselves are the benchmark's (docs/benchmarks.md), not asserted."""
    import shutil

    from lt_opd_ray.cli.main import main
    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.sources.resolve import resolve_model_dir

    folder = tmp_path / "student"
    shutil.copytree(resolve_model_dir("toy:circles") if engine == "transformers" else tiny_dirs["qwen3_vl"], folder)
    CompressionConfig("cdpruner", 500, 2).write(folder)
    assert main(["efficiency", str(folder), "--measure", "--repeats", "1", "--max-new-tokens", "3", "--budgets", "500", "--image", "224x224"]) == 0
    out = capsys.readouterr().out
    assert f"measured on {engine} (CPU)" in out and "differ from what the engine prefilled" not in out
    full, pruned = (line.split() for line in out.splitlines()[-3:-1])
    assert full[:1] == ["100%"] and pruned[:1] == ["5%"] and int(pruned[1]) < int(full[1])
    assert all(float(row[i]) > 0 for row in (full, pruned) for i in (2, 5))  # first token ms, end-to-end ms
    assert all(row[4] == "n/a" or float(row[4]) == float(row[4]) for row in (full, pruned))  # decode ms/token: n/a without a second token
    assert main(["efficiency", "--preset", "qwen3.5-4b", "--measure"]) == 2
    assert "--measure times a model folder's serving engine: give the folder, not --preset" in capsys.readouterr().err
    assert main(["efficiency", str(folder), "--measure", "--images", "2"]) == 2
    assert "--measure times one image per request" in capsys.readouterr().err
