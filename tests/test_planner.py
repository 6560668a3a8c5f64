"""The capacity planner against the efficiency module's counts, its schedules' ordering and its refusals."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.planning.efficiency import (
    lm_flops,
    patch_grid,
    prefill_cost,
    vision_attention_flops,
    vision_projection_flops,
)
from lt_opd_ray.planning.planner import EFFICIENCY, GPUS, best_split, plan, shapes_of, update_work
from lt_opd_ray.planning.presets import PRESETS

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


def test_a_clip_per_prompt_is_its_temporal_patches_each_pruned_and_its_timestamps():
    """`--frames 16`: 8 temporal patches of the frame size, each pruned to the budget on its own and run through the
    vision tower like an image, and 8 timestamps of 8 text tokens each (Qwen3.5's layout), brute force against the
    one-image work."""
    from dataclasses import replace

    shapes = replace(paper_shapes(), image=(448, 448), frames=16)
    work = update_work(CONFIG, shapes, EFFICIENCY)
    grid = patch_grid(CONFIG, 448, 448)
    vision = 8 * (vision_projection_flops(CONFIG, grid) + vision_attention_flops(CONFIG, grid))
    reduced = prefill_cost(CONFIG, 84 + 8 * 8, [grid] * 8, 500, 32)
    assert reduced.visual_tokens == 8 * max(32, -(-196 * 500 // 10000))  # k_min 32 of each patch's 196 tokens
    assert work.rollout_prefill_flops == pytest.approx(80 * vision + 80 * 8 * reduced.lm_flops, rel=1e-12)
    mean = round(EFFICIENCY["mean_response_fraction"] * shapes.max_new_tokens)
    assert work.learner_tokens == 80 * 8 * (reduced.prefill_tokens + mean)


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
    with pytest.raises(ValueError, match=r"no split of 3 A100-80GB SXM GPUs holds the learner's states under ZeRO-2 \(20 B/param"):
        best_split(CONFIG, shapes, GPUS["a100"], 3, EFFICIENCY, "staleness 1")  # 20 B/param on one 80 GB GPU


def test_the_learner_fit_counts_every_byte_and_two_ranks_of_4b_need_80_gb_gpus():
    from lt_opd_ray.planning.planner import (
        LEARNER_BYTES_PER_PARAM,
        learner_fits,
        learner_gb_per_gpu,
        update_work,
        zero_stage_for,
    )

    work = update_work(CONFIG, paper_shapes(), EFFICIENCY)
    per_param = {stage: sum(w + p for w, p in held.values()) for stage, held in LEARNER_BYTES_PER_PARAM.items()}
    assert per_param == {2: 20, 3: 20}  # bf16 weights 2, bf16 grads 2, fp32 master 4, Adam 8, fp32 grads 4: ZeRO-2 keeps the bf16 ones whole
    head = 2 * CONFIG["text_config"]["hidden_size"] * CONFIG["text_config"]["vocab_size"]
    assert learner_gb_per_gpu(work, 2, 3) == pytest.approx((20 * work.params / 2 + 2 * head) / 1e9 + 8)
    assert learner_gb_per_gpu(work, 2, 2) == pytest.approx((4 * work.params + 16 * work.params / 2) / 1e9 + 8)
    assert learner_fits(work, GPUS["a100"], 2) and not learner_fits(work, GPUS["a100-40gb"], 2)  # p4de, not p4d
    assert zero_stage_for(work, GPUS["a100"], 2) == 2  # 62.4 GB of 80: no parameter gathers
    assert zero_stage_for(work, GPUS["a100-40gb"], 4) == 3 and zero_stage_for(work, GPUS["a100-40gb"], 2) is None


def test_engine_batches_teacher_backends_and_links_are_modelled_as_the_code_runs():
    from dataclasses import replace

    from lt_opd_ray.planning.planner import link_bytes_per_second, rollout_seconds

    shapes, gpu = paper_shapes(), GPUS["a100"]
    work = update_work(CONFIG, shapes, EFFICIENCY)
    full_engines = rollout_seconds(work, shapes, gpu, 4, EFFICIENCY)
    one_group = rollout_seconds(work, replace(shapes, engine_batch=8), gpu, 4, EFFICIENCY)  # transformers, or engine_groups 1
    assert one_group > 10 * full_engines  # 20 waves of 8 against one of 160 per engine (memory-bound decode)
    by_vllm = update_work(CONFIG, replace(shapes, teacher_backend="vllm"), EFFICIENCY)
    grid = patch_grid(CONFIG, 896, 832)
    full = prefill_cost(CONFIG, 84, [grid], 10000, 32)
    assert by_vllm.teacher_flops - work.teacher_flops == pytest.approx((640 - 80) * full.lm_flops)  # the prompt again per response
    assert link_bytes_per_second(gpu, 8, EFFICIENCY) == 600e9 * EFFICIENCY["link"]  # one node: NVLink
    assert link_bytes_per_second(gpu, 16, EFFICIENCY) == 50e9 * EFFICIENCY["link"]  # two p4de nodes: EFA
    zero3 = plan(CONFIG, replace(shapes, zero_stage=3), gpu, (4, 2, 2), EFFICIENCY).phases["learner"]
    assert zero3 > plan(CONFIG, replace(shapes, zero_stage=2), gpu, (4, 2, 2), EFFICIENCY).phases["learner"]  # the gathers cost


def test_plan_command_prints_an_estimate_and_names_bad_input():
    cli = [sys.executable, "-m", "lt_opd_ray.cli.main", "plan", "jobs/train_qwen35.yaml", "--gpus", "8"]
    out = subprocess.run([*cli, "--gpu", "h200", "--preset", "qwen3.5-4b"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ESTIMATE (analytic, not measured)") and re.search(r"\d+ s/update, \d+\.\dx (faster|slower) than the paper's 311 s", out.stdout)
    assert "learner memory per GPU (job's split, 2 ZeRO-2 ranks): 62.4 GB of 141 GB, fits (the job's stage)" in out.stdout
    assert "learner ZeRO stage for this split: ZeRO-2 (fits, and gathers no parameters)" in out.stdout
    assert "train_mfu 0.35: MFU of the learner's forward + backward; assumed" in out.stdout  # every efficiency with its source
    assert "note: the teacher admits 64 scoring requests at once (pools.teacher.replicas 2 x 32, twice max_batch_size) and 80 rollout groups" in out.stdout
    small = subprocess.run([*cli, "--gpu", "a100-40gb", "--preset", "qwen3.5-4b"], cwd=REPO, capture_output=True, text=True)
    assert "55.9 GB of 40 GB, DOES NOT FIT" in small.stdout and "more learner ranks" in small.stdout  # p4d.24xlarge
    bad = subprocess.run([*cli, "--preset", "qwen3.5-4b", "--efficiency", "mfu=0.5"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "--efficiency 'mfu=0.5': unknown name" in bad.stderr
    named = subprocess.run(cli, cwd=REPO, capture_output=True, text=True)  # models/Qwen3.5-4B is not here: its preset is
    assert named.returncode == 0 and "model preset qwen3.5-4b (named by model.path; models/Qwen3.5-4B/config.json not here)" in named.stdout
    unnamed = subprocess.run([*cli, "--set", "model.path=models/other"], cwd=REPO, capture_output=True, text=True)
    assert unnamed.returncode == 2 and "model.path names no preset; pass --preset (qwen3.5-4b, qwen3.5-9b, glm-4.6v-flash)" in unnamed.stderr
    nine = subprocess.run([*cli[:4], "jobs/train_qwen35_9b.yaml", "--gpus", "8", "--gpu", "a100"], cwd=REPO, capture_output=True, text=True)
    assert "model preset qwen3.5-9b (named by model.path" in nine.stdout  # the 9B job's split fits 80 GB by its own plan
    assert "learner memory per GPU (job's split, 4 ZeRO-3 ranks): 54.0 GB of 80 GB, fits (the job's stage)" in nine.stdout


def test_static_batches_logit_passes_dtype_and_the_zero3_gather_before_a_sync():
    from dataclasses import replace

    from lt_opd_ray.planning.planner import LOGIT_PASSES, logit_seconds, rollout_seconds, sync_seconds

    shapes, gpu = paper_shapes(), GPUS["a100"]
    text = CONFIG["text_config"]
    work = update_work(CONFIG, shapes, EFFICIENCY)
    # a transformers worker: its whole share in one static batch, every row decoded to the cap
    static = update_work(CONFIG, replace(shapes, engine_batch=None), EFFICIENCY)
    assert static.decode_seq_steps == shapes.max_new_tokens and work.decode_seq_steps == pytest.approx(shapes.max_new_tokens / 2, rel=1e-3)
    assert rollout_seconds(static, replace(shapes, engine_batch=None), gpu, 4, EFFICIENCY) > rollout_seconds(work, shapes, gpu, 4, EFFICIENCY)
    # each role's passes over the fp32 logits of every response position, by brute force
    positions = 640 * EFFICIENCY["mean_response_fraction"] * 1024
    rate = gpu.memory_tbps * 1e12 * EFFICIENCY["logit_bandwidth"]
    for role in ("teacher", "learner"):
        assert logit_seconds(work, gpu, 2, role, EFFICIENCY) == pytest.approx(positions * 4 * text["vocab_size"] * LOGIT_PASSES[role] / 2 / rate)
    # decode reads the language model's linear layers and the (tied) head, not the vision tower
    assert 0.8 * work.params < work.decoded_params < work.params
    # an fp32 job: 4 B per parameter on the wire; ZeRO-3 ranks gather every parameter first
    fp32 = update_work(CONFIG, replace(shapes, dtype_bytes=4), EFFICIENCY)
    assert fp32.sync_bytes == 4 * work.params
    link = link_bytes(gpu)
    assert sync_seconds(work, shapes, gpu, (4, 2, 2), EFFICIENCY) == pytest.approx(2 * work.params / link)
    assert sync_seconds(work, replace(shapes, zero_stage=3), gpu, (4, 2, 2), EFFICIENCY) == pytest.approx(2 * work.params * 1.5 / link)


def link_bytes(gpu):
    return gpu.link_gbps * 1e9 * EFFICIENCY["link"]


def test_a_learner_that_cannot_hold_its_state_is_refused_before_start():
    """ZeRO-2 over 2 ranks holds bf16 weights and gradients whole (2 + 2 B/param) and half of the fp32 master weights,
    Adam's moments and fp32 gradients (16 / 2 B/param): 12 B/param, 54 GB for Qwen3.5-4B."""
    from lt_opd_ray.config.loading import load_job
    from lt_opd_ray.planning.planner import parameter_count
    from lt_opd_ray.planning.presets import PRESETS
    from lt_opd_ray.runtime.resources import InsufficientResourcesError, check_learner_memory, learner_state_bytes

    config = PRESETS["qwen3.5-4b"]
    job = load_job(REPO / "jobs" / "train_qwen35.yaml")
    assert learner_state_bytes(job, config) == 12 * parameter_count(config)
    gpu_node = lambda kind: {"Alive": True, "Resources": {"GPU": 8.0, f"accelerator_type:{kind}": 1.0, "memory": 1e12}}  # noqa: E731
    check_learner_memory(job, config, [gpu_node("A100-80G")])
    check_learner_memory(job, config, [{"Alive": True, "Resources": {"GPU": 8.0, "memory": 1e12}}])  # GPUs of no known type: not checked
    with pytest.raises(InsufficientResourcesError, match=r"take 54.4 GB under ZeRO-2 over 2 rank\(s\), more than the 40 GB"):
        check_learner_memory(job, config, [gpu_node("A100-40G")])
    cpu = job.model_copy(update={"pools": job.pools.model_copy(update={"learner": job.pools.learner.model_copy(update={"gpus": 0.0})})})
    with pytest.raises(InsufficientResourcesError, match=r"2 CPU learner rank\(s\) on one node hold 108.8 GB"):
        check_learner_memory(cpu, config, [{"Alive": True, "Resources": {"memory": 64e9}}])
    check_learner_memory(cpu, config, [{"Alive": True, "Resources": {"memory": 64e9}}] * 2)  # a rank per node fits


def test_a_vllm_engine_that_cannot_hold_the_weights_and_one_longest_sequence_is_refused_before_start():
    """The main job's vLLM rollout engine on Qwen3.5-4B (bf16): its weights plus one sequence of the job's longest
    length (1003520 px / 32² = 980 image tokens + 1024 text + 1024 response), counted from the config by hand here:
    refused when its GPU share is below that, started when above."""
    from lt_opd_ray.config.loading import load_job
    from lt_opd_ray.planning.planner import context_length, parameter_count
    from lt_opd_ray.planning.presets import PRESETS
    from lt_opd_ray.runtime.resources import InsufficientResourcesError, check_engine_memory

    config = PRESETS["qwen3.5-4b"]
    job = load_job(REPO / "jobs" / "train_qwen35.yaml")
    assert context_length(job, config) == 1003520 // 32**2 + 1024 + 1024
    text = config["text_config"]
    full = sum(kind == "full_attention" for kind in text["layer_types"])
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv = full * 2 * 3028 * text["num_key_value_heads"] * head_dim * 2
    linear = len(text["layer_types"]) - full
    conv_channels = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"] + text["linear_num_value_heads"] * text["linear_value_head_dim"]
    state = linear * (conv_channels * text["linear_conv_kernel_dim"] * 2
                      + text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * 4)
    need = parameter_count(config) * 2 + kv + state
    h100 = [{"Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:H100": 1.0, "memory": 1e12}}]

    def with_share(share: float):
        rollout = job.pools.rollout.model_copy(update={"vllm": job.pools.rollout.vllm.model_copy(update={"gpu_memory_utilization": share})})
        return job.model_copy(update={"pools": job.pools.model_copy(update={"rollout": rollout})})

    check_engine_memory(job, config, h100)  # 0.85 of 80 GB
    check_engine_memory(with_share(need / 80e9 * 1.01), config, h100)
    with pytest.raises(InsufficientResourcesError, match=r"pools.rollout's vLLM engine needs .* one 3028-token sequence .* more than its"):
        check_engine_memory(with_share(need / 80e9 * 0.99), config, h100)
    check_engine_memory(with_share(0.01), config, [{"Alive": True, "Resources": {"GPU": 8.0, "memory": 1e12}}])  # unnamed GPUs: not checked


def test_a_job_without_a_teacher_is_planned_without_one_and_names_the_gpus_it_frees():
    """The RL baselines read no teacher scores: the job's split and every best split give the teacher no GPU and no
    time, the update's work has no teacher FLOPs, and `lt-opd plan` says which GPUs the teacher pool would have taken."""
    from lt_opd_ray.planning.planner import job_split

    rl = ["objective.mode=grpo", "reward.name=answer", "sampling.temperature=1", "sampling.top_p=1"]
    job = load_job(REPO / "jobs/train_qwen35.yaml", rl)
    shapes = shapes_of(job, 84, (896, 832))
    assert shapes.teacher_backend is None and update_work(CONFIG, shapes, EFFICIENCY).teacher_flops == 0.0
    assert job_split(job) == (4, 0, 2) and job_split(load_job(REPO / "jobs/train_qwen35.yaml")) == (4, 2, 2)
    for schedule in ("synchronous", "staleness 1"):
        best = best_split(CONFIG, shapes, GPUS["h200"], 8, EFFICIENCY, schedule)
        assert best.split[1] == 0 and sum(best.split) == 8 and best.phases["teacher"] == 0.0
    with_teacher = best_split(CONFIG, paper_shapes(), GPUS["h200"], 8, EFFICIENCY, "staleness 1")
    assert with_teacher.split[1] >= 1 and with_teacher.phases["teacher"] > 0
    cli = [sys.executable, "-m", "lt_opd_ray.cli.main", "plan", "jobs/train_qwen35.yaml", "--gpus", "6", "--gpu", "h200", "--preset", "qwen3.5-4b"]
    out = subprocess.run([*cli, *(f"--set={o}" for o in rl)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "no teacher pool (objective.mode grpo reads no teacher scores): the 2 GPU(s) of pools.teacher are free" in out.stdout
    assert re.search(r"job's split\s+4/0/2\s", out.stdout) and "teacher 0%" in out.stdout and "note: the teacher admits" not in out.stdout
    # a reward judged by a model: its own pool, counted by the fit check and named by the plan
    from lt_opd_ray.runtime.resources import pool_demands

    judged = ["reward.name=judge", "reward.judge=tiny:qwen3_5", "pools.reward.max_replicas=2", "pools.reward.replicas=2", "pools.reward.gpus=1"]
    assert pool_demands(load_job(REPO / "jobs/train_qwen35.yaml", [*rl, *judged]))["reward"] == {"CPU": 2.0, "GPU": 2.0}
    assert "reward" not in pool_demands(job)
    out = subprocess.run([*cli, *(f"--set={o}" for o in [*rl, *judged])], cwd=REPO, capture_output=True, text=True)
    assert ("reward judge (reward.judge tiny:qwen3_5, the student's layout (tiny:qwen3_5/config.json not here)): pools.reward takes 2 GPU(s)"
            " (2 replica(s) x 1) of the 6; the splits below share the other 4. Its forwards: ") in out.stdout, out.stderr
    assert re.search(r"\nsplit\s+1/0/3\s", out.stdout), out.stdout  # the job's own 4/0/2 needs more than the 4 left: the best split of 4
    # the judge's time: a full-token prefill per response (prompt, mean response, question), the images once per prompt
    from dataclasses import replace

    from lt_opd_ray.planning.planner import judge_seconds

    seconds = float(re.search(r"Its forwards: ([0-9.]+) s an update", out.stdout)[1])
    shapes = paper_shapes()
    assert seconds == pytest.approx(judge_seconds(CONFIG, shapes, GPUS["h200"], 2, EFFICIENCY), abs=0.05)
    assert judge_seconds(CONFIG, shapes, GPUS["h200"], 1, EFFICIENCY) == pytest.approx(2 * judge_seconds(CONFIG, shapes, GPUS["h200"], 2, EFFICIENCY))
    doubled = judge_seconds(CONFIG, replace(shapes, n=2 * shapes.n), GPUS["h200"], 2, EFFICIENCY) / judge_seconds(CONFIG, shapes, GPUS["h200"], 2, EFFICIENCY)
    assert 1.5 < doubled < 2  # twice the responses: twice the language model, the same vision tower


def test_several_optimizer_steps_an_update_cost_the_optimizer_each_and_the_old_policys_forward():
    """jobs/train_qwen35_grpo.yaml takes 4 steps an update: the optimizer's traffic 4 times, and the learners' extra
    forward without gradients over the later 3/4 of the sequences (the old policy) on top of the 3 passes (4 with
    activation checkpointing) of training, the output head's GEMM included."""
    from dataclasses import replace

    shapes = shapes_of(load_job(REPO / "jobs/train_qwen35_grpo.yaml"), 84, (896, 832))
    assert (shapes.steps_per_update, shapes.recorded_share) == (4, 0.75)
    one = replace(shapes, steps_per_update=1, recorded_share=0.0)
    four, single = update_work(CONFIG, shapes, EFFICIENCY), update_work(CONFIG, one, EFFICIENCY)
    assert four.optimizer_bytes == 4 * single.optimizer_bytes
    assert four.learner_flops == pytest.approx(single.learner_flops * (4 + 0.75) / 4, rel=1e-12)  # 4 passes (checkpointing) + 3/4
