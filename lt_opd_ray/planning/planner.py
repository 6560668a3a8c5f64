"""Capacity planner: seconds per update of a job on N GPUs, per phase and schedule, and a pool split.

An analytic model, not a measurement. Work comes from the job's shapes and the
efficiency module's FLOP counts; time from each GPU's peak figures times a stated
efficiency (`EFFICIENCY`, overridable). Per update:

- rollout (decode, memory-bound): a worker's sequences decode in one engine batch as the
  code runs them (vLLM: every group it holds, up to `max_num_seqs`, finished sequences
  leaving the batch; transformers: all its groups in one static batch, every row computed
  until the longest finishes), in as many waves as that batch needs; each of a wave's
  `max_new_tokens` decode steps reads the language model's weights and the head once plus
  the KV cache of the sequences still running, or is compute-bound if 2 x those
  parameters x running sequences is slower, and
  then makes LOGIT_PASSES["decode"] fp32 passes over the running rows' full-vocabulary
  logits (sampling and top-k log-probs); sequences finish uniformly over the steps (the
  mean response is `mean_response_fraction` of the maximum), a wave runs until its
  longest response. Plus one reduced prefill per sequence (the n samples of a prompt
  share its vision pass, not its prefill: they are scheduled in the same step).
- teacher, per backend: transformers runs each prompt's full-token prefix once and its
  responses continue from the cache; vLLM prefills the full prompt with every response
  (it reads no prefix cache for prompt-logprob requests). The full-vocabulary head at
  response positions only, and LOGIT_PASSES["teacher"] passes over each one's logits.
- learner: forward + backward = 3x the forward FLOPs (4x with activation
  checkpointing) of every reduced prompt + response and the vision tower once per
  prompt; the head at response positions 4x (the chunked head recomputes its logits in
  backward) and LOGIT_PASSES["learner"] passes over its logits; plus the optimizer's traffic
  (OPTIMIZER_BYTES_PER_PARAM, sharded over the ranks), and ZeRO's collectives per
  micro-batch over the link between the ranks (gradients reduced in every backward;
  ZeRO-3 also gathers every parameter in every forward, backward and recompute), not
  overlapped with compute. A rank fits when it holds every byte its ZeRO stage keeps per
  parameter (LEARNER_BYTES_PER_PARAM), ZeRO-3's largest gathered parameter twice, and
  LEARNER_HEADROOM_GB; `zero_stage_for` picks ZeRO-2 where it fits (no gathers).
- sync: the weights in the job's dtype from learner rank 0 to the rollout workers, over NVLink when
  every pool is on one node, else over the nodes' network; under ZeRO-3 the learner ranks
  first gather every parameter.

The model's structure is checked against a measured run on CPU, phase by phase, with that machine's rates
measured by microbenchmarks (`benchmarks/bench_planner.py`; docs/gpu.md has its table).

Schedules: synchronous (phases in series), streaming (max_staleness 0: teacher and
learner work on groups as they are sampled, so an update costs its slowest pool plus
the other pools' share of one group at the end), staleness 1 (the next update's
rollouts overlap this update's learner step: the slowest pool plus the sync).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from lt_opd_ray.planning.efficiency import (
    _text,
    cache_bytes,
    clip_text_tokens,
    lm_flops,
    lm_projection_flops_per_token,
    patch_grid,
    prefill_cost,
)


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense peak
    memory_gb: float
    memory_tbps: float  # HBM bandwidth
    link_gbps: float  # per-GPU interconnect bandwidth inside a node (NVLink), GB/s
    network_gbps: float  # a node's network bandwidth to other nodes (its instance's EFA), GB/s
    gpus_per_node: int = 8


GPUS = {  # vendor datasheet figures (SXM parts); networks of the AWS instances that carry them (p4d/p4de 400 Gb/s, p5/p5e 3,200 Gb/s)
    "a100": GPU("A100-80GB SXM", 312.0, 80.0, 2.039, 600.0, 50.0),  # p4de.24xlarge
    "a100-40gb": GPU("A100-40GB SXM", 312.0, 40.0, 1.555, 600.0, 50.0),  # p4d.24xlarge
    "h100": GPU("H100 SXM", 989.0, 80.0, 3.35, 900.0, 400.0),  # p5.48xlarge
    "h200": GPU("H200 SXM", 989.0, 141.0, 4.8, 900.0, 400.0),  # p5e.48xlarge
}

# Fractions of peak each phase reaches. Every one is an assumption, none is measured on a GPU here; the source of
# each is in EFFICIENCY_SOURCES and `lt-opd plan` prints it. Override with --efficiency NAME=VALUE.
EFFICIENCY = {
    "memory_bandwidth": 0.6,
    "logit_bandwidth": 0.5,
    "decode_compute": 0.3,
    "prefill_mfu": 0.45,
    "train_mfu": 0.35,
    "link": 0.5,
    "mean_response_fraction": 0.5,
}
EFFICIENCY_SOURCES = {
    "memory_bandwidth": "fraction of HBM bandwidth a decode step streams its weights and KV cache at; assumed, typical of vLLM's"
                        " published decode throughput",
    "logit_bandwidth": "fraction of HBM bandwidth a pass over full-vocabulary logits reaches (log-softmax, top-k, the sampler's"
                       " softmax and cumulative sum; LOGIT_PASSES counts them per role); assumed (measured on a CPU: 0.11 of its"
                       " memory stream, bound by the exponentials and the selection; benchmarks/bench_planner.py)",
    "decode_compute": "MFU of a compute-bound decode step; assumed",
    "prefill_mfu": "MFU of teacher and rollout prefills; assumed, typical of published vLLM / transformers prefill on bf16 4B models",
    "train_mfu": "MFU of the learner's forward + backward; assumed, typical of Megatron / DeepSpeed figures, and only with the gpu"
                 " extra's linear-attention kernels (without them Qwen3.5's 24 Gated DeltaNet layers run >10x slower)",
    "link": "fraction of NVLink or the network a collective reaches (weight sync, ZeRO's reductions and gathers); assumed",
    "mean_response_fraction": "mean response length / max_new_tokens; assumed (the paper gives none)",
}

SCHEDULES = ("synchronous", "streaming", "staleness 1")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # a job's model.dtype


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
    engine_batch: int | None  # sequences one rollout engine decodes at once, as the code feeds it; None: a worker's whole share,
    # in one static batch (transformers: every row runs until the batch's longest response)
    teacher_backend: str | None  # "transformers" (shared prompt cache) or "vllm" (a full prefill per response); None: no teacher
    # (the objective reads no teacher scores: the SFT modes, the RL baselines)
    micro_batch_tokens: int  # the learner's token budget per micro-batch
    zero_stage: int
    dtype_bytes: int = 2  # the job's compute dtype: weights read per decode step, KV cache, weight sync
    frames: int = 0  # a clip of this many frames of `image`'s size per prompt instead of one image (two frames per temporal patch)
    steps_per_update: int = 1  # optimizer steps an update (optimizer.steps_per_update): the optimizer's traffic each
    recorded_share: float = 0.0  # share of the update's sequences the learners forward once more, without gradients,
    # before the first step (an RL baseline's old policy for the later steps: (K - 1) / K)

    def prompt_grids(self, config: dict) -> tuple[list[tuple[int, int, int]], int]:
        """(patch grid of each image or temporal patch, text tokens) of one prompt: one image, or a clip's patches with
        their timestamp and marker tokens."""
        grid = patch_grid(config, *self.image)
        if not self.frames:
            return [grid], self.text_tokens
        patches = self.frames // 2
        return [grid] * patches, self.text_tokens + clip_text_tokens(config, patches)


@dataclass(frozen=True)
class Work:
    """One update's work in FLOPs and bytes, independent of the GPUs (decode per sequence: it depends on the batch)."""

    params: int
    decoded_params: int  # what a decode step reads and multiplies: the language model's linear layers and the output head
    sequences: int
    rollout_prefill_flops: float
    decode_steps: int
    decode_seq_steps: float  # one sequence's Σ over decode steps of its share still running (the mean response / 1)
    decode_kv_bytes: float  # one sequence's Σ over decode steps of the KV cache it has read
    logit_bytes: float  # one full-vocabulary fp32 row
    teacher_flops: float
    response_positions: float  # where the teacher scores and the learner's loss reads the full-vocabulary head
    learner_flops: float
    learner_tokens: float  # reduced prompt + response positions over the update's sequences
    optimizer_bytes: float
    sync_bytes: float
    gathered_bytes: float  # the largest parameter a ZeRO-3 rank gathers whole: the bf16 output head / embedding


# What a learner rank holds per parameter in DeepSpeed's bf16 mode: (bytes every rank holds whole, bytes partitioned over the ranks).
# The fp32 gradients are where an update's micro-batches accumulate (`runtime/learner.deepspeed_config`: grad_accum_dtype fp32)
LEARNER_BYTES_PER_PARAM = {
    2: {"bf16 weights": (2, 0), "bf16 gradients": (2, 0), "fp32 master weights": (0, 4), "Adam m and v (fp32)": (0, 8), "fp32 gradients": (0, 4)},
    3: {"bf16 weights": (0, 2), "bf16 gradients": (0, 2), "fp32 master weights": (0, 4), "Adam m and v (fp32)": (0, 8), "fp32 gradients": (0, 4)},
}
REDUCED_GRADIENT_BYTES = 4  # the ranks reduce gradients in fp32 (`deepspeed_config`'s communication_data_type)
LEARNER_HEADROOM_GB = 8.0  # activations of one micro-batch with per-block recompute, allocator slack, NCCL buffers
# Adam's step per parameter: reads fp32 weight, gradient, m, v (16 B), writes weight, m, v (12 B); then the bf16 copy (reads 4, writes 2)
OPTIMIZER_BYTES_PER_PARAM = 34
# fp32 passes over one position's full-vocabulary logits after the head's GEMM, counted in the code: a decode step reads and
# writes the log-softmax, reads it for the top-k, reads and writes the sampler's softmax and its cumulative sum (7); the teacher
# reads for the log-sum-exp and again for the top-k of the logits (2); the learner's chunked head reads for the log-sum-exp in
# forward, then reads and writes the softmax and the gradient in backward (5)
LOGIT_PASSES = {"decode": 7, "teacher": 2, "learner": 5}


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
    grids, text_tokens = shapes.prompt_grids(config)
    reduced = prefill_cost(config, text_tokens, grids, shapes.budget_bps, shapes.k_min)
    full = prefill_cost(config, text_tokens, grids, 10000, shapes.k_min)
    sequences = shapes.prompts * shapes.n
    mean = efficiency["mean_response_fraction"] * shapes.max_new_tokens
    head = 2 * text["hidden_size"] * text["vocab_size"]  # output head per position (full vocabulary)
    vision = full.vision_flops  # the tower runs on every patch at any budget
    # response positions continue a prefix: FLOPs of (prefix + response) minus the prefix alone
    response = lambda prefix: lm_flops(config, prefix + round(mean)) - lm_flops(config, prefix)  # noqa: E731
    # decode: with uniform finishing, a sequence's share still running falls linearly to 0 over 2 x mean steps
    steps = shapes.max_new_tokens
    running = [max(0.0, 1 - s / (2 * mean)) for s in range(steps)] if mean else [0.0] * steps
    if shapes.engine_batch is None:  # a static batch computes every row until its longest response
        running = [1.0] * steps
    kv_per_token = cache_bytes(config, 1, shapes.dtype_bytes)[0]  # keys + values of one cached token
    prompt_passes = shapes.prompts if shapes.teacher_backend == "transformers" else sequences  # full-token prefills
    passes = 4 if shapes.checkpointing else 3
    passes += shapes.recorded_share  # the old policy's forward over the later mini-batches
    return Work(
        params=params,
        decoded_params=lm_projection_flops_per_token(config) // 2 + text["vocab_size"] * text["hidden_size"],
        sequences=sequences,
        rollout_prefill_flops=shapes.prompts * vision + sequences * reduced.lm_flops,
        decode_steps=steps,
        decode_seq_steps=sum(running),
        decode_kv_bytes=sum(r * (reduced.prefill_tokens + s) * kv_per_token for s, r in enumerate(running)),
        logit_bytes=4 * text["vocab_size"],
        teacher_flops=(shapes.prompts * vision + prompt_passes * full.lm_flops + sequences * (response(full.prefill_tokens) + mean * head)
                       if shapes.teacher_backend else 0.0),
        response_positions=sequences * mean,
        # the chunked head runs its GEMM 4 times (forward, its recompute in backward, both gradients), checkpointing or
        # not, and once more where the old policy is recorded
        learner_flops=(passes * (sequences * (reduced.lm_flops + response(reduced.prefill_tokens)) + shapes.prompts * vision)
                       + (4 + shapes.recorded_share) * sequences * mean * head),
        learner_tokens=sequences * (reduced.prefill_tokens + mean),
        optimizer_bytes=OPTIMIZER_BYTES_PER_PARAM * params * shapes.steps_per_update,
        sync_bytes=shapes.dtype_bytes * params,
        gathered_bytes=2 * text["hidden_size"] * text["vocab_size"],
    )


@dataclass(frozen=True)
class Plan:
    split: tuple[int, int, int]  # rollout, teacher, learner GPUs
    phases: dict[str, float]  # rollout, teacher, learner, sync seconds
    step: dict[str, float]  # schedule -> seconds per update
    busy: dict[str, dict[str, float]]  # schedule -> pool -> busy fraction


def link_bytes_per_second(gpu: GPU, gpus: int, efficiency: dict) -> float:
    """What a collective among `gpus` GPUs reaches: NVLink inside one node, else the nodes' network."""
    return (gpu.link_gbps if gpus <= gpu.gpus_per_node else gpu.network_gbps) * 1e9 * efficiency["link"]


def rollout_seconds(work: Work, shapes: Shapes, gpu: GPU, rollout_gpus: int, efficiency: dict) -> float:
    """Decode of one rollout GPU's share, in waves of the engine's batch, plus the prefills."""
    peak = gpu.bf16_tflops * 1e12
    bandwidth = gpu.memory_tbps * 1e12 * efficiency["memory_bandwidth"]
    share = math.ceil(work.sequences / rollout_gpus)  # sequences per engine
    batch = min(shapes.engine_batch or share, share)
    waves = math.ceil(share / batch)
    weights = work.decode_steps * shapes.dtype_bytes * work.decoded_params / bandwidth  # every decode step of a wave reads them
    wave_memory = weights + batch * work.decode_kv_bytes / bandwidth
    wave_compute = 2 * work.decoded_params * batch * work.decode_seq_steps / (peak * efficiency["decode_compute"])
    wave_logits = batch * work.decode_seq_steps * work.logit_bytes * LOGIT_PASSES["decode"] / (gpu.memory_tbps * 1e12 * efficiency["logit_bandwidth"])
    return waves * (max(wave_memory, wave_compute) + wave_logits) + work.rollout_prefill_flops / rollout_gpus / (peak * efficiency["prefill_mfu"])


def logit_seconds(work: Work, gpu: GPU, gpus: int, role: str, efficiency: dict) -> float:
    """A role's passes over the full-vocabulary logits of every response position, shared over its GPUs."""
    return work.response_positions * work.logit_bytes * LOGIT_PASSES[role] / gpus / (gpu.memory_tbps * 1e12 * efficiency["logit_bandwidth"])


def learner_seconds(work: Work, shapes: Shapes, gpu: GPU, learner_gpus: int, efficiency: dict) -> float:
    """Compute, the optimizer's traffic, and ZeRO's per-micro-batch collectives between the ranks (not overlapped)."""
    peak = gpu.bf16_tflops * 1e12
    seconds = work.learner_flops / learner_gpus / (peak * efficiency["train_mfu"]) + logit_seconds(work, gpu, learner_gpus, "learner", efficiency)
    seconds += work.optimizer_bytes / learner_gpus / (gpu.memory_tbps * 1e12)
    if learner_gpus > 1:
        micro_batches = math.ceil(work.learner_tokens / learner_gpus / shapes.micro_batch_tokens)
        others = (learner_gpus - 1) / learner_gpus  # the share of a collective's bytes a rank sends or receives
        passes = (4 if shapes.checkpointing else 3) if shapes.zero_stage == 3 else 0  # parameter gathers per micro-batch
        traffic = micro_batches * (REDUCED_GRADIENT_BYTES + passes * shapes.dtype_bytes) * work.params * others  # gradients reduced, weights gathered
        seconds += traffic / link_bytes_per_second(gpu, learner_gpus, efficiency)
    return seconds


def phase_seconds(work: Work, shapes: Shapes, gpu: GPU, split: tuple[int, int, int], efficiency: dict) -> dict[str, float]:
    rollout_gpus, teacher_gpus, learner_gpus = split
    peak = gpu.bf16_tflops * 1e12
    return {
        "rollout": rollout_seconds(work, shapes, gpu, rollout_gpus, efficiency),
        "teacher": (work.teacher_flops / teacher_gpus / (peak * efficiency["prefill_mfu"]) + logit_seconds(work, gpu, teacher_gpus, "teacher", efficiency)
                    if teacher_gpus else 0.0),  # no teacher pool
        "learner": learner_seconds(work, shapes, gpu, learner_gpus, efficiency),
        "sync": sync_seconds(work, shapes, gpu, split, efficiency),
    }


def sync_seconds(work: Work, shapes: Shapes, gpu: GPU, split: tuple[int, int, int], efficiency: dict) -> float:
    """The weights from learner rank 0 to every rollout worker; under ZeRO-3 the ranks first gather every parameter."""
    learner_gpus = split[2]
    seconds = work.sync_bytes / link_bytes_per_second(gpu, sum(split), efficiency)
    if shapes.zero_stage == 3 and learner_gpus > 1:
        seconds += work.sync_bytes * (learner_gpus - 1) / learner_gpus / link_bytes_per_second(gpu, learner_gpus, efficiency)
    return seconds


def schedule_seconds(phases: dict[str, float], groups_per_update: int) -> dict[str, float]:
    pools = phases["rollout"] + phases["teacher"] + phases["learner"]
    slowest = max(phases["rollout"], phases["teacher"], phases["learner"])
    tail = (pools - slowest) / groups_per_update  # the other pools' share of the last group
    sync = phases["sync"]
    return {"synchronous": pools + sync, "streaming": slowest + tail + sync, "staleness 1": slowest + sync}


def plan(config: dict, shapes: Shapes, gpu: GPU, split: tuple[int, int, int], efficiency: dict) -> Plan:
    work = update_work(config, shapes, efficiency)
    phases = phase_seconds(work, shapes, gpu, split, efficiency)
    groups = max(1, shapes.prompts // shapes.group_prompts)
    step = schedule_seconds(phases, groups)
    busy = {name: {pool: phases[pool] / seconds for pool in ("rollout", "teacher", "learner")} for name, seconds in step.items()}
    return Plan(split, phases, step, busy)


def learner_gb_per_gpu(work: Work, learner_gpus: int, zero_stage: int = 3) -> float:
    """One rank's memory: every per-parameter byte of its ZeRO stage (LEARNER_BYTES_PER_PARAM), ZeRO-3's largest
    gathered parameter (twice: the one in use and the next prefetched), and the headroom."""
    held = sum(whole + part / learner_gpus for whole, part in LEARNER_BYTES_PER_PARAM[zero_stage].values()) * work.params
    gathered = 2 * work.gathered_bytes if zero_stage == 3 else 0
    return (held + gathered) / 1e9 + LEARNER_HEADROOM_GB


def learner_fits(work: Work, gpu: GPU, learner_gpus: int, zero_stage: int = 3) -> bool:
    return learner_gb_per_gpu(work, learner_gpus, zero_stage) <= gpu.memory_gb


def zero_stage_for(work: Work, gpu: GPU, learner_gpus: int) -> int | None:
    """ZeRO-2 where it fits (no parameter gathers), else ZeRO-3 where that fits, else None."""
    return next((stage for stage in (2, 3) if learner_fits(work, gpu, learner_gpus, stage)), None)


def best_split(config: dict, shapes: Shapes, gpu: GPU, gpus: int, efficiency: dict, schedule: str) -> Plan:
    work = update_work(config, shapes, efficiency)
    candidates = [
        plan(config, shapes, gpu, (r, t, gpus - r - t), efficiency)
        for r, t in itertools.product(range(1, gpus), range(1, gpus) if shapes.teacher_backend else [0])
        if gpus - r - t >= 1 and learner_fits(work, gpu, gpus - r - t, shapes.zero_stage)
    ]
    if not candidates:
        per_param = sum(whole + part for whole, part in LEARNER_BYTES_PER_PARAM[shapes.zero_stage].values())
        raise ValueError(f"no split of {gpus} {gpu.name} GPUs holds the learner's states under ZeRO-{shapes.zero_stage} ({per_param} B/param:"
                         f" {per_param * work.params / 1e9:.0f} GB, plus {learner_gb_per_gpu(work, 10**9, shapes.zero_stage):.0f} GB per rank)")
    return min(candidates, key=lambda p: (p.step[schedule], p.split))


TEXT_TOKENS = 1024  # room for the system prompt, the question and the chat template around one image


def context_length(job, config: dict) -> int:
    """Longest sequence a job sends (a vLLM engine's max_model_len): data.max_images images at data.max_pixels, a clip
    where data.max_videos asks (its temporal patches, each at most data.max_pixels: the Qwen video processors' own
    per-frame cap, 768 tokens, is below the default's 980, and its timestamps), the text, the response; within the
    model's positions."""
    vision = config.get("vision_config", {})
    token_pixels = (vision.get("patch_size", 16) * vision.get("spatial_merge_size", 2)) ** 2
    patches = job.data.frames // vision.get("temporal_patch_size", 2)
    clip = job.data.max_videos * (patches * (job.data.max_pixels // token_pixels) + clip_text_tokens(config, patches))
    wanted = job.data.max_images * (job.data.max_pixels // token_pixels) + clip + TEXT_TOKENS + job.sampling.max_new_tokens
    text = config.get("text_config", config)
    return min(wanted, int(text.get("max_position_embeddings", wanted)))


def engine_batch(job) -> int | None:
    """Sequences one rollout engine decodes at once, as the workers feed it: every group a vLLM worker holds (up to
    engine_groups, within max_num_seqs); None on transformers, whose worker samples all its groups as one static batch."""
    pool, group = job.pools.rollout, job.schedule.group_prompts * job.sampling.n
    return min(pool.vllm.max_num_seqs, pool.engine_groups * group) if pool.backend == "vllm" else None


def shapes_of(job, text_tokens: int, image: tuple[int, int], frames: int = 0) -> Shapes:
    return Shapes(
        prompts=job.sampling.prompts_per_step, n=job.sampling.n, max_new_tokens=job.sampling.max_new_tokens,
        text_tokens=text_tokens, image=image, budget_bps=job.budget.target_bps, k_min=job.budget.k_min, top_k=job.objective.top_k,
        checkpointing=job.pools.learner.activation_checkpointing, group_prompts=job.schedule.group_prompts,
        engine_batch=engine_batch(job), teacher_backend=job.pools.teacher.backend if job.objective.teacher_scores else None,
        micro_batch_tokens=job.pools.learner.micro_batch_tokens, zero_stage=job.pools.learner.zero_stage,
        dtype_bytes=DTYPE_BYTES[job.model.dtype], frames=frames, steps_per_update=job.optimizer.steps_per_update,
        recorded_share=(job.optimizer.steps_per_update - 1) / job.optimizer.steps_per_update if job.objective.policy_gradient else 0.0,
    )


def job_split(job) -> tuple[int, int, int]:
    """The GPUs the job's own pools ask for (rollout workers, teacher replicas, learner ranks); no teacher's where the
    objective reads no teacher scores (`teacher_gpus`: what it would take)."""
    pools = job.pools
    return (max(1, math.ceil(pools.rollout.workers * pools.rollout.gpus)), teacher_gpus(job) if job.objective.teacher_scores else 0,
            max(1, math.ceil(pools.learner.ranks * pools.learner.gpus)))


JUDGE_QUESTION_TOKENS = 40  # the judge's question around a response: the reference answer and the yes/no ask (evals/judge.py)


def judge_seconds(config: dict, shapes: Shapes, gpu: GPU, gpus: int, efficiency: dict) -> float:
    """The reward judge's forwards of one update on its `gpus`, `config` its model's layout: per response one
    full-token prefill of the prompt, the mean response and the question around it (the head at its last position
    only), each prompt's images encoded once for its group."""
    grids, text_tokens = shapes.prompt_grids(config)
    asked = text_tokens + round(efficiency["mean_response_fraction"] * shapes.max_new_tokens) + JUDGE_QUESTION_TOKENS
    question = prefill_cost(config, asked, grids, 10000, shapes.k_min)  # every visual token kept
    flops = shapes.prompts * question.vision_flops + shapes.prompts * shapes.n * question.lm_flops
    return flops / gpus / (gpu.bf16_tflops * 1e12 * efficiency["prefill_mfu"])


def reward_gpus(job) -> int:
    """The GPUs the reward judge's pool takes at its initial replicas; none where the reward needs no model."""
    return math.ceil(job.pools.reward.replicas * job.pools.reward.gpus) if job.reward.uses_judge else 0


def teacher_gpus(job) -> int:
    """The GPUs the job's teacher pool takes at its initial replicas."""
    return max(1, math.ceil(job.pools.teacher.replicas * job.pools.teacher.gpus))
