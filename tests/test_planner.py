"""The capacity planner against the efficiency module's counts, its schedules' ordering and its refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lt_opd_ray.config import load_job
from lt_opd_ray.efficiency import PRESETS, lm_flops, patch_grid, prefill_cost, vision_attention_flops, vision_projection_flops
from lt_opd_ray.planner import EFFICIENCY, GPUS, best_split, plan, shapes_of, update_work

REPO = Path(__file__).resolve().parents[1]
CONFIG = PRESETS["qwen3.5-4b"]


def paper_shapes():
    return shapes_of(load_job(REPO / "jobs/train_qwen35.yaml"), 84, (896, 832))


def test_work_is_the_efficiency_modules_counts_summed_over_the_update():
    shapes = paper_shapes()
    work = update_work(CONFIG, shapes, EFFICIENCY)
    mean = round(EFFICIENCY["mean_response_fraction"] * shapes.max_new_tokens)
    grid = patch_grid(CONFIG, 896, 832)
    vision = vision_projection_flops(CONFIG, grid) + vision_attention_flops(CONFIG, grid)
    reduced = prefill_cost(CONFIG, 84, [grid], 500, 32).prefill_tokens
    full = prefill_cost(CONFIG, 84, [grid], 10000, 32).prefill_tokens
    head = 2 * 2560 * 248320
    sequences = 80 * 8
    # each sequence forwarded whole (prompt + mean response) by brute force, the head at response positions
    learner = 4 * (sequences * (lm_flops(CONFIG, reduced + mean) + mean * head) + 80 * vision)  # checkpointing: 4 passes
    teacher = 80 * (lm_flops(CONFIG, full) + vision) + sequences * (lm_flops(CONFIG, full + mean) - lm_flops(CONFIG, full) + mean * head)
    assert work.learner_flops == pytest.approx(learner, rel=1e-12)
    assert work.teacher_flops == pytest.approx(teacher, rel=1e-12)
    assert 3.5e9 < work.params < 5.5e9  # a 4B-class model
    assert work.sync_bytes == 2 * work.params


def test_schedules_order_and_pools_scale():
    shapes = paper_shapes()
    for split in [(4, 2, 2), (2, 1, 5), (1, 1, 6)]:
        p = plan(CONFIG, shapes, GPUS["a100"], split, EFFICIENCY)
        assert p.step["synchronous"] > p.step["streaming"] >= p.step["staleness 1"] >= max(p.phases[k] for k in ("rollout", "teacher", "learner"))
        assert p.step["synchronous"] == pytest.approx(sum(p.phases.values()))
    small, large = (plan(CONFIG, shapes, GPUS["a100"], split, EFFICIENCY) for split in [(2, 2, 2), (2, 4, 2)])
    assert small.phases["teacher"] == pytest.approx(2 * large.phases["teacher"])  # compute-bound: halves with twice the GPUs
    assert plan(CONFIG, shapes, GPUS["h200"], (2, 1, 5), EFFICIENCY).step["staleness 1"] < plan(CONFIG, shapes, GPUS["a100"], (2, 1, 5), EFFICIENCY).step["staleness 1"]


def test_best_split_uses_every_gpu_and_refuses_a_learner_that_cannot_hold_its_states():
    shapes = paper_shapes()
    best = best_split(CONFIG, shapes, GPUS["a100"], 8, EFFICIENCY, "staleness 1")
    assert sum(best.split) == 8 and min(best.split) >= 1
    with pytest.raises(ValueError, match=r"no split of 3 A100-80GB SXM GPUs holds the learner's states \(20 B/param"):
        best_split(CONFIG, shapes, GPUS["a100"], 3, EFFICIENCY, "staleness 1")  # 20 B/param on one 80 GB GPU


def test_the_learner_fit_counts_every_byte_and_two_ranks_of_4b_need_80_gb_gpus():
    from lt_opd_ray.planner import ZERO3_BYTES_PER_PARAM, learner_gb_per_gpu, learner_fits, update_work

    work = update_work(CONFIG, paper_shapes(), EFFICIENCY)
    assert sum(ZERO3_BYTES_PER_PARAM.values()) == 20  # bf16 weights 2, fp32 master 4, Adam 8, fp32 grads 4, bf16 grads 2
    by_hand = (20 * work.params / 2 + 2 * 2 * CONFIG["text_config"]["hidden_size"] * CONFIG["text_config"]["vocab_size"]) / 1e9 + 8
    assert learner_gb_per_gpu(work, 2) == pytest.approx(by_hand)
    assert learner_fits(work, GPUS["a100"], 2) and not learner_fits(work, GPUS["a100-40gb"], 2)  # p4de, not p4d


def test_plan_command_prints_an_estimate_and_names_bad_input():
    cli = [sys.executable, "-m", "lt_opd_ray.cli", "plan", "jobs/train_qwen35.yaml", "--gpus", "8"]
    out = subprocess.run([*cli, "--gpu", "h200", "--preset", "qwen3.5-4b"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ESTIMATE (analytic, not measured)") and "x the paper's 311 s/update" in out.stdout
    assert "learner memory per GPU (job's split, 2 ZeRO-3 ranks): 55.9 GB of 141 GB, fits" in out.stdout
    small = subprocess.run([*cli, "--gpu", "a100-40gb", "--preset", "qwen3.5-4b"], cwd=REPO, capture_output=True, text=True)
    assert "55.9 GB of 40 GB, DOES NOT FIT" in small.stdout  # p4d.24xlarge
    bad = subprocess.run([*cli, "--preset", "qwen3.5-4b", "--efficiency", "mfu=0.5"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "--efficiency 'mfu=0.5': unknown name" in bad.stderr
    missing = subprocess.run(cli, cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "pass --preset qwen3.5-4b" in missing.stderr
