"""Capacity planner: seconds per update of a job on N GPUs, per phase and schedule, and a pool split.

An analytic model, not a measurement. Work comes from the job's shapes and the
efficiency module's FLOP counts; time from each GPU's peak figures times a stated
efficiency (`EFFICIENCY`, overridable). Per update:

- rollout (decode, memory-bound): each of the `max_new_tokens` decode steps reads the
  weights once per rollout GPU plus the KV cache of the sequences still running, or
  is compute-bound if 2 x params x running sequences is slower; sequences finish
  uniformly over the steps (the mean response is `mean_response_fraction` of the
  maximum), the batch runs until its longest response. Plus the reduced prefills.
- teacher: one full-token prefill per prompt + a forward over every response token,
  with the full-vocabulary head at response positions only.
- learner: forward + backward = 3x the forward FLOPs (4x with activation
  checkpointing) of every reduced prompt + response, the vision tower once per
  prompt, the head at response positions; plus the optimizer reading and writing
  its fp32 states (16 bytes per parameter, sharded over the ranks). A split fits when each learner
  rank holds every byte ZeRO-3 keeps per parameter (ZERO3_BYTES_PER_PARAM: 20 B in bf16 mode) over
  the ranks, the largest gathered parameter twice, and LEARNER_HEADROOM_GB.
- sync: the weights in bf16 over the GPU interconnect.

Schedules: synchronous (phases in series), streaming (max_staleness 0: teacher and
learner work on groups as they are sampled, so an update costs its slowest pool plus
the other pools' share of one group at the end), staleness 1 (the next update's
rollouts overlap this update's learner step: the slowest pool plus the sync).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .efficiency import _text, cache_bytes, lm_flops, lm_projection_flops_per_token, patch_grid, prefill_cost, vision_attention_flops, vision_projection_flops


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense peak
    memory_gb: float
    memory_tbps: float  # HBM bandwidth
    link_gbps: float  # per-GPU interconnect bandwidth (NVLink), GB/s


GPUS = {  # vendor datasheet figures (SXM parts)
    "a100": GPU("A100-80GB SXM", 312.0, 80.0, 2.039, 600.0),
    "a100-40gb": GPU("A100-40GB SXM", 312.0, 40.0, 1.555, 600.0),  # p4d.24xlarge
    "h100": GPU("H100 SXM", 989.0, 80.0, 3.35, 900.0),
    "h200": GPU("H200 SXM", 989.0, 141.0, 4.8, 900.0),
}

# Fractions of peak each phase reaches: assumed, typical of published vLLM / Megatron / DeepSpeed figures
# for a 4B model; override with --efficiency NAME=VALUE.
EFFICIENCY = {
    "decode_bandwidth": 0.6,  # fraction of HBM bandwidth a decode step streams at
    "decode_compute": 0.3,  # MFU of a compute-bound decode step
    "prefill_mfu": 0.45,  # teacher prefill and rollout prefill
    "train_mfu": 0.35,  # learner forward + backward (ZeRO-3, bf16)
    "link": 0.5,  # fraction of the interconnect a weight broadcast reaches
    "mean_response_fraction": 0.5,  # mean response length / max_new_tokens
}

SCHEDULES = ("synchronous", "streaming", "staleness 1")


@dataclass(frozen=True)
class Shapes:
    prompts: int
    n: int
    max_new_tokens: int
    text_tokens: int
    image: tuple[int, int]
    budget_bps: int
    k_min: int
    top_k: int
    checkpointing: bool
    group_prompts: int


@dataclass(frozen=True)
class Work:
    """One update's work in FLOPs and bytes, independent of the GPUs."""

    params: int
    rollout_prefill_flops: float
    decode_steps: int
    decode_seq_steps: float  # Σ over decode steps of the sequences still running
    decode_kv_bytes: float  # Σ over decode steps of the KV cache read (all sequences)
    teacher_flops: float
    learner_flops: float
    optimizer_bytes: float
    sync_bytes: float
    gathered_bytes: float  # the largest parameter a ZeRO-3 rank gathers whole: the bf16 output head / embedding


# What a ZeRO-3 learner rank holds per parameter in DeepSpeed's bf16 mode, partitioned over the ranks.
ZERO3_BYTES_PER_PARAM = {
    "bf16 weights": 2,
    "fp32 master weights": 4,
    "Adam m and v (fp32)": 8,
    "fp32 gradients (partition)": 4,
    "bf16 gradients (partition)": 2,
}
LEARNER_HEADROOM_GB = 8.0  # activations of one micro-batch with per-block recompute, allocator slack, NCCL buffers


def parameter_count(config: dict) -> int:
    text, vision = _text(config), config["vision_config"]
    embeddings = text["vocab_size"] * text["hidden_size"] * (1 if config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)) else 2)
    width = vision["hidden_size"]
    inner = vision.get("intermediate_size") or 4 * width
    merge = vision["spatial_merge_size"]
    out = vision.get("out_hidden_size") or text["hidden_size"]
    vision_params = vision["depth"] * (4 * width * width + 2 * width * inner) + (width * merge**2) ** 2 + width * merge**2 * out
    return lm_projection_flops_per_token(config) // 2 + embeddings + vision_params


def update_work(config: dict, shapes: Shapes, efficiency: dict) -> Work:
    text = _text(config)
    params = parameter_count(config)
    grid = patch_grid(config, *shapes.image)
    reduced = prefill_cost(config, shapes.text_tokens, [grid], shapes.budget_bps, shapes.k_min)
    full = prefill_cost(config, shapes.text_tokens, [grid], 10000, shapes.k_min)
    sequences = shapes.prompts * shapes.n
    mean = efficiency["mean_response_fraction"] * shapes.max_new_tokens
    head = 2 * text["hidden_size"] * text["vocab_size"]  # output head per position (full vocabulary)
    vision = vision_projection_flops(config, grid) + vision_attention_flops(config, grid)
    # response positions continue a prefix: FLOPs of (prefix + response) minus the prefix alone
    response = lambda prefix: lm_flops(config, prefix + round(mean)) - lm_flops(config, prefix)  # noqa: E731
    # decode: all sequences start together; with uniform finishing, running(s) falls linearly to 0 over
    # 2 x mean steps (capped at the maximum), the batch lasting until the longest response
    steps = shapes.max_new_tokens
    running = [sequences * max(0.0, 1 - s / (2 * mean)) for s in range(steps)] if mean else [0.0] * steps
    kv_per_token = cache_bytes(config, 1)[0]  # bf16 keys + values of one cached token
    kv_read = sum(r * (reduced.prefill_tokens + s) * kv_per_token for s, r in enumerate(running))
    passes = 4 if shapes.checkpointing else 3
    return Work(
        params=params,
        rollout_prefill_flops=shapes.prompts * (reduced.lm_flops + vision),
        decode_steps=steps,
        decode_seq_steps=sum(running),
        decode_kv_bytes=kv_read,
        teacher_flops=shapes.prompts * (full.lm_flops + vision) + sequences * (response(full.prefill_tokens) + mean * head),
        learner_flops=passes * (sequences * (reduced.lm_flops + response(reduced.prefill_tokens) + mean * head) + shapes.prompts * vision),
        optimizer_bytes=2 * 16 * params,  # Adam reads and writes master weights, m, v and gradients in fp32
        sync_bytes=2 * params,
        gathered_bytes=2 * text["hidden_size"] * text["vocab_size"],
    )


@dataclass(frozen=True)
class Plan:
    split: tuple[int, int, int]  # rollout, teacher, learner GPUs
    phases: dict[str, float]  # rollout, teacher, learner, sync seconds
    step: dict[str, float]  # schedule -> seconds per update
    busy: dict[str, dict[str, float]]  # schedule -> pool -> busy fraction


def phase_seconds(work: Work, gpu: GPU, split: tuple[int, int, int], efficiency: dict) -> dict[str, float]:
    rollout_gpus, teacher_gpus, learner_gpus = split
    peak = gpu.bf16_tflops * 1e12
    bandwidth = gpu.memory_tbps * 1e12 * efficiency["decode_bandwidth"]
    per_step_weights = 2 * work.params / bandwidth  # every decode step reads the bf16 weights on each rollout GPU
    memory = work.decode_steps * per_step_weights + work.decode_kv_bytes / rollout_gpus / bandwidth
    compute = 2 * work.params * work.decode_seq_steps / rollout_gpus / (peak * efficiency["decode_compute"])
    decode = max(memory, compute)
    return {
        "rollout": decode + work.rollout_prefill_flops / rollout_gpus / (peak * efficiency["prefill_mfu"]),
        "teacher": work.teacher_flops / teacher_gpus / (peak * efficiency["prefill_mfu"]),
        "learner": work.learner_flops / learner_gpus / (peak * efficiency["train_mfu"])
        + work.optimizer_bytes / learner_gpus / (gpu.memory_tbps * 1e12),
        "sync": work.sync_bytes / (gpu.link_gbps * 1e9 * efficiency["link"]),
    }


def schedule_seconds(phases: dict[str, float], groups_per_update: int) -> dict[str, float]:
    r, t, l, s = phases["rollout"], phases["teacher"], phases["learner"], phases["sync"]
    slowest = max(r, t, l)
    tail = (r + t + l - slowest) / groups_per_update  # the other pools' share of the last group
    return {"synchronous": r + t + l + s, "streaming": slowest + tail + s, "staleness 1": slowest + s}


def plan(config: dict, shapes: Shapes, gpu: GPU, split: tuple[int, int, int], efficiency: dict) -> Plan:
    work = update_work(config, shapes, efficiency)
    phases = phase_seconds(work, gpu, split, efficiency)
    groups = max(1, shapes.prompts // shapes.group_prompts)
    step = schedule_seconds(phases, groups)
    busy = {name: {pool: phases[pool] / seconds for pool in ("rollout", "teacher", "learner")} for name, seconds in step.items()}
    return Plan(split, phases, step, busy)


def learner_gb_per_gpu(work: Work, learner_gpus: int) -> float:
    """One ZeRO-3 rank's memory: every per-parameter byte (ZERO3_BYTES_PER_PARAM) over the ranks, the largest
    gathered parameter (twice: the one in use and the next prefetched), and the headroom."""
    partitioned = sum(ZERO3_BYTES_PER_PARAM.values()) * work.params / learner_gpus
    return (partitioned + 2 * work.gathered_bytes) / 1e9 + LEARNER_HEADROOM_GB


def learner_fits(work: Work, gpu: GPU, learner_gpus: int) -> bool:
    return learner_gb_per_gpu(work, learner_gpus) <= gpu.memory_gb


def best_split(config: dict, shapes: Shapes, gpu: GPU, gpus: int, efficiency: dict, schedule: str) -> Plan:
    work = update_work(config, shapes, efficiency)
    candidates = [
        plan(config, shapes, gpu, (r, t, gpus - r - t), efficiency)
        for r, t in itertools.product(range(1, gpus), repeat=2)
        if gpus - r - t >= 1 and learner_fits(work, gpu, gpus - r - t)
    ]
    if not candidates:
        per_param = sum(ZERO3_BYTES_PER_PARAM.values())
        raise ValueError(f"no split of {gpus} {gpu.name} GPUs holds the learner's states ({per_param} B/param:"
                         f" {per_param * work.params / 1e9:.0f} GB, plus {learner_gb_per_gpu(work, 10**9):.0f} GB per rank)")
    return min(candidates, key=lambda p: (p.step[schedule], p.split))


def shapes_of(job, text_tokens: int, image: tuple[int, int]) -> Shapes:
    return Shapes(
        prompts=job.sampling.prompts_per_step, n=job.sampling.n, max_new_tokens=job.sampling.max_new_tokens,
        text_tokens=text_tokens, image=image, budget_bps=job.budget.target_bps, k_min=job.budget.k_min, top_k=job.objective.top_k,
        checkpointing=job.pools.learner.activation_checkpointing, group_prompts=job.schedule.group_prompts,
    )


def job_split(job) -> tuple[int, int, int]:
    """The GPUs the job's own pools ask for (rollout workers, teacher replicas, learner ranks)."""
    pools = job.pools
    return (max(1, math.ceil(pools.rollout.workers * pools.rollout.gpus)), max(1, math.ceil(pools.teacher.replicas * pools.teacher.gpus)),
            max(1, math.ceil(pools.learner.ranks * pools.learner.gpus)))
