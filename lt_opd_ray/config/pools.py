"""The job's actor pools: each pool's resources and settings (`pools.rollout`, `pools.teacher`, `pools.learner`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lt_opd_ray.config.base import (
    MAX_ACTOR_CPUS,
    MAX_ACTOR_GPUS,
    MAX_ACTORS_PER_POOL,
    MAX_PROMPTS_PER_STEP,
    MAX_SEQUENCE_TOKENS,
    MAX_WAIT_S,
    StrictModel,
)


class Resources(StrictModel):
    cpus: float = Field(1.0, ge=0.0, le=MAX_ACTOR_CPUS)
    """CPUs reserved per actor."""
    gpus: float = Field(0.0, ge=0.0, le=MAX_ACTOR_GPUS)
    """GPUs reserved per actor."""
    node_resource: str | None = None
    """Custom Ray resource each actor takes one unit of, pinning the pool to the nodes that
    advertise it (the node types / worker groups in cluster/); None places it anywhere."""

    def ray_resources(self) -> dict[str, float]:
        """Custom resources of one actor, in Ray's `resources=` form."""
        return {self.node_resource: 1.0} if self.node_resource else {}


class VLLMSettings(StrictModel):
    """What a GPU user tunes of a pool's vLLM engines (ignored by the transformers backend; on CPU vLLM runs
    eager, and its CPU KV cache is sized by VLLM_CPU_KVCACHE_SPACE instead of a memory share)."""

    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Share of its GPU's memory one engine takes for weights, activations and KV cache; engines sharing a GPU
    (pools with gpus < 1) need shares that sum to at most 1."""
    max_num_seqs: int = Field(256, ge=1, le=MAX_PROMPTS_PER_STEP)
    """Sequences one engine batches at a time (vLLM's continuous batching)."""
    enforce_eager: bool = False
    """Skip CUDA graph capture: faster start, slower decoding."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of a prompt's shared prefix across its n responses."""


class RolloutPool(Resources):
    workers: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Rollout workers, each owning one engine with the current student."""
    backend: Literal["transformers", "vllm"] = "transformers"
    """Inference engine of the rollout workers."""
    vllm: VLLMSettings = VLLMSettings()
    """The rollout workers' vLLM engines (backend vllm)."""
    engine_groups: int = Field(32, ge=1, le=MAX_PROMPTS_PER_STEP)
    """Rollout groups a vLLM worker feeds into its one engine at once: their sequences share vLLM's continuous
    batch (up to vllm.max_num_seqs) and each group is handed on as soon as its own sequences finish. 1 samples
    one group at a time: on a CPU, where a decode step costs in proportion to its batch, that keeps the teacher and
    learners busy on early groups and was faster for the paper-shaped job (docs/gpu.md). A transformers worker
    samples all its groups of an update as one batch."""
    verify_weights: bool = False
    """Each worker hashes the weights it is sent (about 1 s per GB), so `checksums()` can prove the engine
    got exactly the learners' weights; needed for a vLLM worker's checksum (it keeps no other copy)."""


class ServePool(Resources):
    """A pool that runs as a Ray Serve deployment, scaled between its bounds by Serve's autoscaler."""

    replicas: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Initial replicas (Ray Serve deployment)."""
    min_replicas: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Autoscaling lower bound."""
    max_replicas: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Autoscaling upper bound."""
    max_batch_size: int = Field(8, ge=1, le=MAX_PROMPTS_PER_STEP)
    """Requests joined into one batch (the teacher scores a batch in one engine call; the judge asks about a batch's
    responses in forwards of at most `pools.reward.micro_batch_tokens`)."""
    target_queue_per_replica: float = Field(2.0, gt=0)
    """Autoscaling target: ongoing (queued + running) requests per replica before Serve adds one."""
    upscale_delay_s: float = Field(5.0, ge=0, le=MAX_WAIT_S)
    """How long the queue must stay above target before a replica is added."""
    downscale_delay_s: float = Field(60.0, ge=0, le=MAX_WAIT_S)
    """How long the queue must stay below target before a replica is removed."""
    load_window_s: float = Field(30.0, gt=0, le=MAX_WAIT_S)
    """How far back Serve averages the ongoing requests it compares with the target (its look_back_period_s)."""

    @property
    def max_ongoing_requests(self) -> int:
        """Requests a replica admits at once (Serve's max_ongoing_requests): twice a batch, so the next batch queues
        at the replica while one runs."""
        return self.max_batch_size * 2

    @model_validator(mode="after")
    def _bounds(self) -> ServePool:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"replicas ({self.replicas}) must lie within [min_replicas, max_replicas]"
                f" = [{self.min_replicas}, {self.max_replicas}]"
            )
        return self


class TeacherPool(ServePool):
    """The frozen full-token teacher's replicas; a request is one rollout group, which holds its slot from the moment it
    is admitted (the replica starts on the group's prompts) until its group is sampled and scored."""

    micro_batch_tokens: int = Field(16384, ge=1, le=64 * MAX_SEQUENCE_TOKENS)
    """Response tokens per teacher forward (their sum when packed, responses x longest when padded); the n responses
    of a prompt share its full-token prompt cache, computed once (each prompt's prefix in a forward of its own)."""
    packing: bool = True
    """The transformers engine continues a prompt's cache with its responses end to end in one row, each seeing the
    prompt and itself (models/packing.py): no padding computed. False: right-padded rows, the cache copied per row."""
    payload_dtype: Literal["float16", "float32"] = "float32"
    """Dtype of the teacher's log-probs on the wire (ids are always int32)."""
    backend: Literal["transformers", "vllm"] = "transformers"
    """Inference engine of the teacher."""
    vllm: VLLMSettings = VLLMSettings()
    """The teacher replicas' vLLM engines (backend vllm)."""


class RewardPool(ServePool):
    """The judge's replicas (`reward.name: judge`): a request is one rollout call's responses, scored by the judge
    model `reward.judge` on the transformers engine. No pool where the reward needs no model."""

    micro_batch_tokens: int = Field(16384, ge=1, le=64 * MAX_SEQUENCE_TOKENS)
    """Tokens per judge forward: its questions (each a row's full-token prompt and one response) packed end to end;
    a question longer than this runs alone."""


class LearnerPool(Resources):
    ranks: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Data-parallel learner ranks (DeepSpeed)."""
    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage."""
    micro_batch_tokens: int = Field(16384, ge=1, le=64 * MAX_SEQUENCE_TOKENS)
    """Tokens per forward/backward: the sum of its sequences' (reduced prompt + response) when packed, sequences x
    longest when padded. A rank's share runs as several micro-batches accumulated into the update's one optimizer
    step, so activation memory follows this budget, not the share. A sequence longer than the budget runs alone."""
    packing: bool = True
    """A micro-batch's sequences end to end in one row (models/packing.py): its forwards compute their tokens and no
    padding, nothing crossing from one sequence to the next. False: left-padded rows (rows x longest)."""
    activation_checkpointing: bool = False
    """Recompute each decoder and vision block in the backward instead of keeping its activations."""
    sync_bucket_mb: float = Field(16.0, gt=0, le=65_536)
    """Size of the flat buckets the weights are broadcast in (4-16 MB measured fastest on gloo; see bench_runtime).
    A bucket never splits a layer (vLLM fuses a layer's weights), so a layer larger than this gets its own."""
    sync_timeout_s: float = Field(300.0, gt=0, le=MAX_WAIT_S)
    """A weight broadcast not finished in this time fails, naming the workers that did not answer."""


class PoolsConfig(StrictModel):
    rollout: RolloutPool = RolloutPool()
    """Student rollout workers."""
    teacher: TeacherPool = TeacherPool()
    """Frozen full-token teacher service."""
    reward: RewardPool = RewardPool()
    """The reward's judge service (reward.name judge)."""
    learner: LearnerPool = LearnerPool()
    """DeepSpeed learner group."""
