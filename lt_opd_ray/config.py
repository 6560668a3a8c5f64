"""Typed schema of a training job, loaded from YAML.

Imports only pydantic and PyYAML, so `lt-opd validate` answers without torch, Ray
or vLLM. Every field carries its meaning as a docstring; unknown keys are errors.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lt_opd_ray.core.curriculum import BPS
from lt_opd_ray.core.storage import check_location

# Upper bounds on counts and sizes: far above any real job, low enough that a typo (an extra 000) is named by
# `validate` instead of starting. What a machine or cluster can hold is checked at preflight (runtime/resources.py).
MAX_ACTORS_PER_POOL = 4096  # rollout workers, teacher replicas, learner ranks
MAX_RESPONSES_PER_PROMPT = 1024  # sampling.n
MAX_PROMPTS_PER_STEP = 65_536
MAX_SEQUENCE_TOKENS = 262_144  # response lengths and token budgets: Qwen3.5's context length
MAX_TOP_K = 1024  # the support of the divergence; the paper's is 100
MAX_UPDATES = 1_000_000  # curriculum lengths and intervals, in updates
MAX_PIXELS = 89_478_485  # PIL's decompression-bomb limit: no larger image decodes
MAX_ACTOR_CPUS, MAX_ACTOR_GPUS = 1024.0, 64.0
MAX_WAIT_S = 7 * 24 * 3600.0  # a week: any longer wait is a hang


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)


def check_data_spec(spec: str) -> str:
    """A generated form (`synthetic:<n>[@<W>x<H>]`, `toy-<task>[-test]:<n>`) checked for shape and task; a file or
    folder is read by `validate` and at preflight, with its own named errors."""
    from lt_opd_ray.sources.resolve import generated_rows

    generated_rows(spec)
    return spec


class ModelConfig(_Strict):
    path: str
    """Hugging Face model directory (local). `tiny:<family>` builds an embedded tiny random model; `toy:<task>` trains a toy task's teacher once (lt_opd_ray/toy)."""

    @field_validator("path")
    @classmethod
    def _known_tiny_family(cls, path: str) -> str:
        from lt_opd_ray.models.tiny import FAMILIES  # stdlib only: validate stays free of torch

        family, _, vocab = path.removeprefix("tiny:").partition("-vocab")
        if path.startswith("tiny:") and (family not in FAMILIES or (vocab and not vocab.isdigit())):
            raise ValueError(f"{path!r}: expected tiny:<family> or tiny:<family>-vocab<N>, family one of {', '.join(FAMILIES)}")
        return path
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Compute dtype of student and teacher forwards (master weights stay fp32)."""


class DataConfig(_Strict):
    path: Annotated[str, AfterValidator(check_data_spec)]
    """A parquet or JSONL file of rows (sample_uid, image, question), `synthetic:<n>` for generated rows, or `toy-<task>:<n>` for a toy task's training rows."""
    image_root: str = "."
    """Folder that relative image paths in the rows are resolved against."""
    min_pixels: int = Field(3136, gt=0, le=MAX_PIXELS)
    """Images smaller than this many pixels are upscaled (Qwen smart-resize rule)."""
    max_pixels: int = Field(1_003_520, gt=0, le=MAX_PIXELS)
    """Images larger than this many pixels are downscaled (Qwen smart-resize rule)."""
    system_prompt: str | None = None
    """Optional system message; never part of the selector's query."""
    shuffle_seed: int = 0
    """Seed of the epoch order of the rows."""

    @model_validator(mode="after")
    def _pixels_ordered(self) -> DataConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        return self


class SelectorConfig(_Strict):
    name: Literal["cdpruner", "divprune", "random", "uniform"] = "cdpruner"
    """Which visual tokens the student keeps: CDPruner (docs/architecture.md §1), DivPrune, seeded random, uniform grid."""
    merge: Literal["none", "learnable"] = "none"
    """`learnable`: each kept token also takes in its discarded cosine neighbours through a trained head (the paper's
    release, with cdpruner; models/token_merge.py); `none`: the discarded tokens are dropped."""


class BudgetConfig(_Strict):
    """The visual-budget curriculum of docs/architecture.md §1, in basis points of the N visual tokens."""

    start_bps: int = Field(2500, gt=0, le=BPS)
    """Budget of the warm-up updates (2500 = 25%)."""
    target_bps: int = Field(500, gt=0, le=BPS)
    """Budget reached at `decay_end` and held afterwards; evaluation always uses it."""
    warm_steps: int = Field(14, ge=0, le=MAX_UPDATES)
    """Updates held at `start_bps` before the cosine decay."""
    decay_end: int = Field(100, ge=0, le=MAX_UPDATES)
    """First update index held at `target_bps`."""
    total_steps: int = Field(175, gt=0, le=MAX_UPDATES)
    """Number of optimizer updates in the run."""
    k_min: int = Field(32, ge=1, le=MAX_SEQUENCE_TOKENS)
    """Floor on kept tokens per image: k = min(N, max(k_min, ceil(N*r)))."""

    @model_validator(mode="after")
    def _ordered(self) -> BudgetConfig:
        if self.target_bps > self.start_bps:
            raise ValueError(f"target_bps ({self.target_bps}) exceeds start_bps ({self.start_bps})")
        if self.decay_end < self.warm_steps:
            raise ValueError(f"decay_end ({self.decay_end}) is before the end of warm_steps ({self.warm_steps})")
        return self


class ObjectiveConfig(_Strict):
    mode: Literal["lt_opd", "fixed_prefix", "sft"] = "lt_opd"
    """What the student learns from. `lt_opd`: its own rollouts at budget r, scored by the teacher
    (docs/architecture.md §1). The ablations of the paper: `fixed_prefix` distils the teacher's distributions on
    responses the full-token teacher sampled; `sft` trains cross-entropy on those responses. Both
    make each rollout worker hold a frozen copy of the initial weights to sample with."""
    divergence: Literal["jsd", "forward_kl", "reverse_kl"] = "jsd"
    """Per-position divergence on the top-k union plus a tail bin."""
    alpha: float = Field(0.5, gt=0.0, lt=1.0)
    """Teacher weight of the generalised JSD mixture M = (1-α)P_S + αP_T."""
    top_k: int = Field(100, ge=1, le=MAX_TOP_K)
    """Size of the student and teacher top-k sets that form the support U."""
    importance_clip: float = Field(2.0, gt=0.0)
    """Truncation of the detached importance weight min(exp(logp - old_logp), clip)."""
    logsoftmax_chunk: int = Field(1024, ge=1, le=MAX_SEQUENCE_TOKENS)
    """Positions per chunk of the full-vocabulary log-softmax (memory is chunk × vocab)."""


class SamplingConfig(_Strict):
    prompts_per_step: int = Field(80, ge=1, le=MAX_PROMPTS_PER_STEP)
    """Prompts per rollout batch (one optimizer step per batch)."""
    n: int = Field(8, ge=1, le=MAX_RESPONSES_PER_PROMPT)
    """Responses sampled per prompt."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of the rollout policy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass of the rollout policy."""
    max_new_tokens: int = Field(1024, ge=1, le=MAX_SEQUENCE_TOKENS)
    """Longest response."""
    stop: list[str] = ["</answer>"]
    """Strings that end a response (besides EOS); the stop string is kept in the response."""


class LearningRates(_Strict):
    language_model: float = Field(1e-6, ge=0.0)
    """Learning rate of the language model (and lm_head)."""
    vision_encoder: float = Field(2e-7, ge=0.0)
    """Learning rate of the vision tower blocks and patch embedding."""
    merger: float = Field(1e-6, ge=0.0)
    """Learning rate of the vision merger (and Qwen3-VL deepstack mergers)."""
    token_merge: float = Field(1e-4, ge=0.0)
    """Learning rate of the learnable token-merge head (selector.merge: learnable; the release trained it at 1e-4)."""


class OptimizerConfig(_Strict):
    lr: LearningRates = LearningRates()
    """Per-module learning rates."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW decoupled weight decay."""
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    warmup_steps: int = Field(14, ge=0, le=MAX_UPDATES)
    """Linear learning-rate warm-up, then constant."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Global gradient-norm clip."""


class Resources(_Strict):
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


class VLLMSettings(_Strict):
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


class TeacherPool(Resources):
    replicas: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Initial teacher replicas (Ray Serve deployment)."""
    min_replicas: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Autoscaling lower bound."""
    max_replicas: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Autoscaling upper bound."""
    max_batch_size: int = Field(8, ge=1, le=MAX_PROMPTS_PER_STEP)
    """Requests (rollout shards) batched together per teacher forward."""
    target_queue_per_replica: float = Field(2.0, gt=0)
    """Autoscaling target: ongoing (queued + running) requests per replica before Serve adds one."""
    upscale_delay_s: float = Field(5.0, ge=0, le=MAX_WAIT_S)
    """How long the queue must stay above target before a replica is added."""
    downscale_delay_s: float = Field(60.0, ge=0, le=MAX_WAIT_S)
    """How long the queue must stay below target before a replica is removed."""
    micro_batch_tokens: int = Field(16384, ge=1, le=64 * MAX_SEQUENCE_TOKENS)
    """Response tokens (responses x longest response) per teacher forward; the n responses of a prompt
    share its full-token prompt cache, computed once (each prompt's prefix in a forward of its own)."""
    payload_dtype: Literal["float16", "float32"] = "float32"
    """Dtype of the teacher's log-probs on the wire (ids are always int32)."""
    backend: Literal["transformers", "vllm"] = "transformers"
    """Inference engine of the teacher."""
    vllm: VLLMSettings = VLLMSettings()
    """The teacher replicas' vLLM engines (backend vllm)."""

    @model_validator(mode="after")
    def _bounds(self) -> TeacherPool:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"replicas ({self.replicas}) must lie within [min_replicas, max_replicas]"
                f" = [{self.min_replicas}, {self.max_replicas}]"
            )
        return self


class LearnerPool(Resources):
    ranks: int = Field(1, ge=1, le=MAX_ACTORS_PER_POOL)
    """Data-parallel learner ranks (DeepSpeed)."""
    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage."""
    micro_batch_tokens: int = Field(16384, ge=1, le=64 * MAX_SEQUENCE_TOKENS)
    """Padded tokens (sequences x longest reduced prompt + response) per forward/backward; a rank's share
    runs as several micro-batches accumulated into the update's one optimizer step, so activation memory
    follows this budget, not the share. A sequence longer than the budget runs alone."""
    activation_checkpointing: bool = False
    """Recompute each decoder and vision block in the backward instead of keeping its activations."""
    sync_bucket_mb: float = Field(16.0, gt=0, le=65_536)
    """Size of the flat buckets the weights are broadcast in (4-16 MB measured fastest on gloo; see bench_runtime).
    A bucket never splits a layer (vLLM fuses a layer's weights), so a layer larger than this gets its own."""
    sync_timeout_s: float = Field(300.0, gt=0, le=MAX_WAIT_S)
    """A weight broadcast not finished in this time fails, naming the workers that did not answer."""


class PoolsConfig(_Strict):
    rollout: RolloutPool = RolloutPool()
    """Student rollout workers."""
    teacher: TeacherPool = TeacherPool()
    """Frozen full-token teacher service."""
    learner: LearnerPool = LearnerPool()
    """DeepSpeed learner group."""


class ScheduleConfig(_Strict):
    """How the pools overlap (docs/architecture.md §4)."""

    max_staleness: Literal[0, 1] = 0
    """0: every update trains on rollouts of the weights it starts from (on-policy). 1: the rollouts of update t+1
    are sampled by the weights of update t while the learners train on update t (one-step off-policy; the clipped
    importance weight corrects for the lag). The learners refuse a rollout staler than this. Deeper lags would
    only queue weight broadcasts behind busy workers, so they are not offered."""
    group_prompts: int = Field(1, ge=1, le=MAX_PROMPTS_PER_STEP)
    """Prompts per rollout group, the unit that streams: a group goes to the teacher and on to its learner rank as
    soon as it is sampled. Smaller: earlier hand-over; larger: bigger engine batches."""
    wait_timeout_s: float = Field(1800.0, gt=0, le=MAX_WAIT_S)
    """Longest wait on any actor (a rollout group, a teacher payload, a learner step, a checkpoint write); one that
    does not answer in time fails the run, naming the role and actor."""
    liveness_timeout_s: float = Field(120.0, gt=0, le=MAX_WAIT_S)
    """While the driver waits on an update, it pings the rollout workers still sampling it and the learner ranks
    every few seconds (answered from a second thread while they work); one that dies is named at once, one that has
    not answered for this long (a frozen process, a lost node), or a learner rank that answers from one step of its
    own work for this long (a hung kernel or collective), is named with what it was doing. A rollout worker is
    stopped and its groups sampled again; for a learner rank the run ends with the checkpoint `--resume` continues
    from. One learner micro-batch's forward or backward must take less than this."""


class CheckpointConfig(_Strict):
    dir: Annotated[str, AfterValidator(check_location)] = "runs/lt-opd"
    """Default runs/<job name>. Where the run's outputs go (checkpoints, steps.jsonl, final/, the resolved job): a folder (on a cluster, one
    every node mounts) or a URI pyarrow opens: s3://bucket/path, gs://, hdfs://, abfs://, file://."""
    staging_dir: str | None = None
    """With `dir` a URI: the local folder (same path on every node) where outputs are written before they are
    uploaded; None: a folder under the system's temp dir."""
    every_steps: int = Field(25, ge=1, le=MAX_UPDATES)
    """Checkpoint interval in optimizer steps."""
    keep: int = Field(2, ge=1, le=MAX_UPDATES)
    """Complete checkpoints kept on disk."""


BenchmarkName = Literal["mmbench", "mmmu", "vstar", "hrbench", "pope", "gqa", "textvqa", "mme", "ocrbench"]


class EvalConfig(_Strict):
    """Scores of the current student during training, on the rollout workers (greedy): answer accuracy on `data`
    (exact match on <answer>) and each benchmark's own metric."""

    data: Annotated[str, AfterValidator(check_data_spec)] | None = None
    """Rows with reference answers (file, `synthetic:<n>`, `toy-<task>-test:<n>`); None: no evaluation."""
    every_steps: int = Field(10, ge=1, le=MAX_UPDATES)
    """Evaluate after every this many optimizer steps (and after the last)."""
    budget_bps: int | None = Field(None, gt=0, le=BPS)
    """Visual budget of the evaluation; None: budget.target_bps."""
    selectors: list[Literal["cdpruner", "divprune", "random", "uniform"]] = ["cdpruner"]
    """Selectors evaluated at that budget (the first is the headline metric)."""
    at_start: bool = False
    """Before the first update of a fresh run, also evaluate `data` at full visual tokens (the reference a retain
    ratio divides by) and at the budget (the untrained student, the baseline training must beat); every later
    evaluation then prints its retain ratio."""
    max_new_tokens: int = Field(16, ge=1, le=MAX_SEQUENCE_TOKENS)
    """Longest answer."""
    benchmarks: dict[BenchmarkName, str] = {}
    """Benchmark files scored with their own metric at the same budget and selectors (name -> file; see `lt-opd eval`)."""

    @property
    def enabled(self) -> bool:
        return self.data is not None or bool(self.benchmarks)


class MetricsConfig(_Strict):
    export_port: int = Field(8090, ge=1024, le=65535)
    """Prometheus export port of the Ray node (outside Ray's worker port range 10002-19999)."""
    log_every: int = Field(1, ge=1, le=MAX_UPDATES)
    """Terminal log interval in steps."""

    @model_validator(mode="after")
    def _outside_worker_ports(self) -> MetricsConfig:
        if 10002 <= self.export_port <= 19999:
            raise ValueError(f"export_port {self.export_port} lies in Ray's worker port range 10002-19999")
        return self


class TrackingConfig(_Strict):
    """Experiment tracking (lt_opd_ray/runtime/tracking.py); each backend's library is an optional extra:
    `pip install 'lt-opd-ray[tracking]'`."""

    backends: list[Literal["tensorboard", "mlflow", "wandb"]] = []
    """Where every update's metrics and the resolved job go; empty: nowhere but steps.jsonl and Prometheus."""
    dir: str | None = None
    """Local folder of the TensorBoard event files, MLflow's sqlite store and W&B's run files; None: <checkpoint.dir>/tracking."""
    project: str = "lt-opd"
    """MLflow experiment / W&B project; the run is named after the job."""
    mlflow_uri: str | None = None
    """MLflow tracking server or store URI; None: `sqlite:///<dir>/mlflow.db`."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B online needs WANDB_API_KEY; offline runs can be uploaded later with `wandb sync`."""


class JobConfig(_Strict):
    """One LT-OPD training job."""

    name: str = "lt-opd"
    """Run name, used in metrics labels and checkpoint folders."""
    seed: int = 0
    """Global seed: sampling, selection and data order derive from it."""
    model: ModelConfig
    """The student/teacher checkpoint (both start from it)."""
    data: DataConfig
    """Training rows."""
    selector: SelectorConfig = SelectorConfig()
    """Visual-token selector of the student."""
    budget: BudgetConfig = BudgetConfig()
    """Visual-budget curriculum."""
    objective: ObjectiveConfig = ObjectiveConfig()
    """Distillation objective."""
    sampling: SamplingConfig = SamplingConfig()
    """Rollout sampling."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW with per-module learning rates."""
    pools: PoolsConfig = PoolsConfig()
    """Actor pools and their resources."""
    schedule: ScheduleConfig = ScheduleConfig()
    """Streaming and staleness: how the pools overlap."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    eval: EvalConfig = EvalConfig()
    """Evaluation during training."""
    metrics: MetricsConfig = MetricsConfig()
    """Metrics export."""
    tracking: TrackingConfig = TrackingConfig()
    """Experiment tracking (TensorBoard, MLflow, W&B)."""

    @property
    def eval_budget_bps(self) -> int:
        """The budget every evaluation of the student runs at: `eval.budget_bps`, else the curriculum's target."""
        return self.eval.budget_bps or self.budget.target_bps

    @model_validator(mode="before")
    @classmethod
    def _run_folder_of_the_job(cls, data):
        """checkpoint.dir defaults to runs/<job name>: jobs of other names never share a folder."""
        if isinstance(data, dict) and isinstance(data.get("checkpoint", {}), dict) and data.get("checkpoint", {}).get("dir") is None:
            data = {**data, "checkpoint": {**data.get("checkpoint", {}), "dir": f"runs/{data.get('name', 'lt-opd')}"}}
        return data


class JobConfigError(ValueError):
    """A job YAML that does not fit the schema; `problems` lists (location, reason)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {where}: {reason}" for where, reason in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


def _yaml_line(root: yaml.Node | None, path: tuple) -> int | None:
    """1-based line of the deepest YAML node along `path` (keys and list indices)."""
    node, line = root, None
    for key in path:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(key)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
    return line


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...], source: str) -> dict:
    """`data` with each `dotted.path=value` set (the value read as YAML: numbers, booleans, lists); sections on the
    path are created as needed, and the schema then judges the result as it judges the file."""
    out = copy.deepcopy(data)
    for override in overrides:
        path, sep, value = override.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise JobConfigError(source, [(f"--set {override}", "expected --set dotted.path=value, e.g. optimizer.lr.language_model=2e-6")])
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise JobConfigError(source, [(f"--set {path}", f"value {value!r} is not valid YAML: {getattr(exc, 'problem', exc)}")]) from None
        node = out
        for depth, key in enumerate(keys[:-1]):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise JobConfigError(source, [(f"--set {path}", f"{'.'.join(keys[: depth + 1])} is a value, not a section")])
        node[keys[-1]] = parsed
    return out


def parse_job(text: str, source: str = "<job>", overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Parse and validate YAML text (with `--set` overrides applied); raise JobConfigError naming every bad field,
    by YAML line, or by the `--set` that gave it."""
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "yaml"
        raise JobConfigError(source, [(where, f"not valid YAML: {getattr(exc, 'problem', exc)}")]) from None
    except RecursionError:
        raise JobConfigError(source, [("yaml", "nested too deeply to be a job (a job is at most four levels deep)")]) from None
    if not isinstance(data, dict):
        raise JobConfigError(source, [("<top>", "a job YAML must be a mapping of sections")])
    data = apply_overrides(data, overrides, source)
    overridden = [o.partition("=")[0].strip() for o in overrides]
    try:
        job = JobConfig.model_validate(data)
    except ValidationError as exc:
        located = []
        for err in exc.errors():
            path = tuple(p for p in err["loc"] if not str(p).startswith("function-after"))
            dotted = ".".join(str(p) for p in path) or "<top>"
            line = _yaml_line(root, path)
            if any(dotted == o or dotted.startswith(o + ".") for o in overridden):
                line, where = 0, f"{dotted} (--set)"
            else:
                where = f"{dotted} (line {line})" if line else dotted
            reason = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            located.append((line or 0, where, reason))
        located.sort(key=lambda item: item[0])  # in file order; fields missing from the file first
        raise JobConfigError(source, [(where, reason) for _, where, reason in located]) from None
    _check_cross_fields(job, source, root)
    return job


def _check_cross_fields(job: JobConfig, source: str, root: yaml.Node | None) -> None:
    """Rules that span sections."""
    problems = []
    # The largest image the processor lets through has max_pixels / (patch*merge)^2 visual tokens
    # at Qwen's 16-pixel patches and 2x2 merge; a k_min above that means the budget never applies.
    max_tokens = math.floor(job.data.max_pixels / (16 * 2) ** 2)
    if job.budget.k_min > max_tokens:
        line = _yaml_line(root, ("budget", "k_min"))
        problems.append(
            (
                f"budget.k_min (line {line})" if line else "budget.k_min",
                f"k_min ({job.budget.k_min}) is above N = {max_tokens}, the visual tokens of the largest"
                f" image allowed by data.max_pixels ({job.data.max_pixels})",
            )
        )
    if job.sampling.prompts_per_step < job.pools.learner.ranks:
        problems.append(
            (
                "pools.learner.ranks",
                f"{job.pools.learner.ranks} ranks but only {job.sampling.prompts_per_step} prompts per update"
                " (sampling.prompts_per_step): every rank needs at least one prompt",
            )
        )
    if job.budget.decay_end > job.budget.total_steps:
        problems.append(("budget.decay_end", f"decay_end ({job.budget.decay_end}) is after total_steps ({job.budget.total_steps})"))
    if problems:
        raise JobConfigError(source, problems)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load and validate a job YAML file, with `--set dotted.path=value` overrides applied."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise JobConfigError(str(path), [("<file>", f"cannot read: {exc.strerror}")]) from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise JobConfigError(str(path), [("<file>", "UTF-16 text: save the job as UTF-8")])
    if b"\x00" in raw:
        raise JobConfigError(str(path), [("<file>", f"binary data (a NUL byte at offset {raw.index(0)}), not a YAML text file")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise JobConfigError(str(path), [(f"line {line}", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}): save the job as UTF-8")]) from None
    return parse_job(text, source=str(path), overrides=overrides)
