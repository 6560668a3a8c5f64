"""Typed schema of a training job, loaded from YAML.

Imports pydantic, PyYAML and the package's torch-free pieces (the budget unit, storage locations, the data-spec
parser), so `lt-opd validate` answers without torch, Ray or vLLM (tests/test_config.py checks it). Every field
carries its meaning as a docstring; unknown keys are errors.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from lt_opd_ray.config.base import (
    MAX_PIXELS,
    MAX_PROMPTS_PER_STEP,
    MAX_SEQUENCE_TOKENS,
    MAX_UPDATES,
    MAX_WAIT_S,
    StrictModel,
    check_data_spec,
)
from lt_opd_ray.config.objective import JUDGE_REWARD, ObjectiveConfig, RewardConfig, SamplingConfig
from lt_opd_ray.config.pools import PoolsConfig
from lt_opd_ray.core.curriculum import BPS
from lt_opd_ray.core.samples import DEFAULT_FRAMES
from lt_opd_ray.core.storage import check_location


class ModelConfig(StrictModel):
    path: str
    """Hugging Face model directory (local). `tiny:<family>` builds an embedded tiny random model; `toy:<task>` trains a toy task's teacher once (lt_opd_ray/toy)."""

    @field_validator("path")
    @classmethod
    def _known_tiny_family(cls, path: str) -> str:
        from lt_opd_ray.core.families import FAMILIES  # stdlib only: validate stays free of torch

        family, _, vocab = path.removeprefix("tiny:").partition("-vocab")
        if path.startswith("tiny:") and (family not in FAMILIES or (vocab and not vocab.isdigit())):
            raise ValueError(f"{path!r}: expected tiny:<family> or tiny:<family>-vocab<N>, family one of {', '.join(FAMILIES)}")
        return path
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Compute dtype of student and teacher forwards (master weights stay fp32)."""


class DataConfig(StrictModel):
    path: Annotated[str, AfterValidator(check_data_spec)]
    """A parquet or JSONL file of rows (sample_uid, image or images and/or video, question), `synthetic:<n>[*<images>]`
    or `synthetic-video:<n>` for generated rows, or `toy-<task>:<n>` for a toy task's training rows
    (`toy-<task>-reference:<n>`: the same rows, each with the response its full-token teacher is trained to write)."""
    image_root: str = "."
    """Folder that relative image paths in the rows are resolved against."""
    allow_outside_root: bool = False
    """Let rows name images and videos outside `image_root` (absolute paths, or climbing out with `..`); off, such a
    row is refused by line: a data file reads only the folder it was given."""
    min_pixels: int = Field(3136, gt=0, le=MAX_PIXELS)
    """Images smaller than this many pixels are upscaled (Qwen smart-resize rule)."""
    max_pixels: int = Field(1_003_520, gt=0, le=MAX_PIXELS)
    """Images larger than this many pixels are downscaled (Qwen smart-resize rule)."""
    frames: int = Field(DEFAULT_FRAMES, ge=2, le=256, multiple_of=2)
    """Frames a row's video is sampled to, uniformly (MVBench's protocol: 16); two frames make one temporal patch. A
    video with fewer frames is refused, naming its row."""
    max_images: int = Field(1, ge=1, le=64)
    """The most images one row shows (rows with an `images` list): vLLM engines reserve room for this many per prompt,
    and a row with more is refused before the job starts. Each image is pruned to the budget on its own."""
    max_videos: int = Field(0, ge=0, le=1)
    """1 where rows may show a clip (after their images) and a role runs vLLM: its engines reserve room for one clip
    per prompt and their context counts `frames` frames. Rows with a clip are refused before the job starts while it
    is 0 and a role runs vLLM; the transformers engines take clips either way."""
    system_prompt: str | None = None
    """Optional system message; never part of the selector's query."""
    shuffle_seed: int = 0
    """Seed of the epoch order of the rows."""

    @model_validator(mode="after")
    def _pixels_ordered(self) -> DataConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        return self


SelectorName = Literal["cdpruner", "divprune", "fastv", "hiprune", "random", "uniform"]  # core/selectors SELECTORS (tests/test_selectors.py holds them equal)


class SelectorConfig(StrictModel):
    name: SelectorName = "cdpruner"
    """Which visual tokens the student keeps: CDPruner (docs/architecture.md §1), DivPrune, HiPrune (the vision encoder's
    own attention), seeded random, uniform grid."""
    merge: Literal["none", "learnable"] = "none"
    """`learnable`: each kept token also takes in its discarded cosine neighbours through a trained head (the paper's
    release, with cdpruner; models/token_merge.py); `none`: the discarded tokens are dropped."""
    scope: Literal["image", "clip", "prompt"] = "image"
    """What one budget covers in a row of several images or a video. `image` (the paper's evaluation protocol): each
    image, and each temporal patch (two frames) of a clip, keeps k_i = min(N_i, max(k_min, ceil(N_i r))) of its own
    N_i tokens. `clip`: images as with `image`, and one budget over the whole clip. `prompt`: one budget over the union
    of everything the prompt shows, k = min(N, max(k_min, ceil(N r))) for N = sum of N_i, the selector choosing across
    images and frames (one may keep none). A one-image row picks the same every way. `clip` and `prompt`: transformers
    engines only."""

    @model_validator(mode="after")
    def _chosen_before_the_language_model(self) -> SelectorConfig:
        if self.name == "fastv":
            raise ValueError("selector fastv prunes inside the language model, after the layer whose attention ranks the"
                             " tokens; the learner replays selections made before it: train with cdpruner, divprune, hiprune,"
                             " random or uniform, and score FastV with eval.selectors or lt-opd eval")
        return self

    @model_validator(mode="after")
    def _hiprune_selects_per_image(self) -> SelectorConfig:
        if self.name == "hiprune" and self.scope != "image":
            raise ValueError(f"selector hiprune with scope {self.scope}: HiPrune's buffers are an image's grid neighbours; use scope image")
        return self

    @model_validator(mode="after")
    def _merge_needs_every_image(self) -> SelectorConfig:
        if self.scope != "image" and self.merge == "learnable":
            raise ValueError(f"scope {self.scope} with merge learnable: an image or frame may keep no token to merge its others into;"
                             " use scope image")
        return self


class BudgetConfig(StrictModel):
    """The visual-budget curriculum of docs/architecture.md §1, in basis points of the N visual tokens."""

    start_bps: int = Field(2500, gt=0, le=BPS)
    """Budget of the warm-up updates (2500 = 25%)."""
    target_bps: int = Field(500, gt=0, le=BPS)
    """Budget reached at `decay_end` and held afterwards; evaluation runs at it unless `eval.budget_bps` says otherwise."""
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


class LearningRates(StrictModel):
    language_model: float = Field(1e-6, ge=0.0)
    """Learning rate of the language model (and lm_head)."""
    vision_encoder: float = Field(2e-7, ge=0.0)
    """Learning rate of the vision tower blocks and patch embedding."""
    merger: float = Field(1e-6, ge=0.0)
    """Learning rate of the vision merger (and Qwen3-VL deepstack mergers)."""
    token_merge: float = Field(1e-4, ge=0.0)
    """Learning rate of the learnable token-merge head (selector.merge: learnable; the release trained it at 1e-4)."""


class OptimizerConfig(StrictModel):
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
    steps_per_update: int = Field(1, ge=1, le=MAX_PROMPTS_PER_STEP)
    """Optimizer steps per update (PPO's mini-batches): each learner rank's prompts split into this many consecutive,
    near-equal mini-batches, one AdamW step each, in order; mini-batch k of the update is every rank's k-th. The
    learning rate moves once per update (warmup_steps counts updates). The RL baselines take the weights that began
    the update as the old policy of every step, so from the second step on the clip bounds how far it moves."""


class ScheduleConfig(StrictModel):
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


class CheckpointConfig(StrictModel):
    dir: Annotated[str, AfterValidator(check_location)] = "runs/lt-opd"
    """Default runs/<job name>. Where the run's outputs go (checkpoints, steps.jsonl, final/, the resolved job): a folder (on a cluster, one
    every node mounts) or a URI pyarrow opens: s3://bucket/path, gs://, hdfs://, abfs://, file://."""
    staging_dir: str | None = None
    """With `dir` a URI: the local folder (same path on every node) where outputs are written before they are
    uploaded: a folder already there must be this user's and writable by no one else (else refused); None: a folder
    under this user's own `lt-opd-ray-<uid>` folder of the system's temp dir, made 0700."""
    every_steps: int = Field(25, ge=1, le=MAX_UPDATES)
    """Checkpoint interval in optimizer steps."""
    keep: int = Field(2, ge=1, le=MAX_UPDATES)
    """Complete checkpoints kept on disk."""


BenchmarkName = Literal["mmbench", "mmmu", "vstar", "hrbench", "pope", "gqa", "textvqa", "mme", "ocrbench", "muirbench", "mvbench"]


class EvalConfig(StrictModel):
    """Scores of the current student during training, on the rollout workers (greedy): answer accuracy on `data`
    (exact match on <answer>) and each benchmark's own metric."""

    data: Annotated[str, AfterValidator(check_data_spec)] | None = None
    """Rows with reference answers (file, `synthetic:<n>`, `toy-<task>-test:<n>`); None: no evaluation."""
    every_steps: int = Field(10, ge=1, le=MAX_UPDATES)
    """Evaluate after every this many optimizer steps (and after the last)."""
    budget_bps: int | None = Field(None, gt=0, le=BPS)
    """Visual budget of the evaluation; None: budget.target_bps."""
    selectors: list[SelectorName] = ["cdpruner"]
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


class MetricsConfig(StrictModel):
    export_port: int = Field(8090, ge=1024, le=65535)
    """Prometheus export port of the Ray node (outside Ray's worker port range 10002-19999)."""
    log_every: int = Field(1, ge=1, le=MAX_UPDATES)
    """Terminal log interval in steps."""

    @model_validator(mode="after")
    def _outside_worker_ports(self) -> MetricsConfig:
        if 10002 <= self.export_port <= 19999:
            raise ValueError(f"export_port {self.export_port} lies in Ray's worker port range 10002-19999")
        return self


class TrackingConfig(StrictModel):
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


class JobConfig(StrictModel):
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
    reward: RewardConfig = RewardConfig()
    """The responses' reward."""
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
    def collective_timeout_s(self) -> float:
        """How long a learner rank waits in a collective for its peers, in every process group of the learners
        (DeepSpeed's own included): longer than a peer may legitimately be away from it. Inside an update a peer may
        wait for its rollouts or its teacher scores (through a worker replacement, a replica restart) until the driver
        ends the update at schedule.wait_timeout_s; in a weight broadcast rank 0 may wait on a slow receiver for up
        to pools.learner.sync_timeout_s while the others sit in ZeRO-3's gather; either plus one micro-batch's compute
        (which schedule.liveness_timeout_s bounds). A shorter timeout would turn the waits the run recovers from into
        a crash of both ranks (NCCL's watchdog)."""
        return max(self.schedule.wait_timeout_s, self.pools.learner.sync_timeout_s) + self.schedule.liveness_timeout_s

    @property
    def teacher_requests_in_flight(self) -> int:
        """The most scoring requests out at once: one per rollout group (a group never crosses a learner rank's
        prompts) of every update in flight (1 + schedule.max_staleness)."""
        from lt_opd_ray.core.microbatch import split_evenly

        ranges = split_evenly(self.sampling.prompts_per_step, self.pools.learner.ranks)
        groups = sum(-(-(stop - start) // self.schedule.group_prompts) for start, stop in ranges)
        return groups * (1 + self.schedule.max_staleness)

    def teacher_admission_note(self) -> str | None:
        """A line for `lt-opd plan` and the start-up output when the teacher's initial replicas admit fewer requests
        at once than the groups in flight: the learner ranks hold the rest back, so the teacher starts on their
        prompts only as slots free (nothing waits on it but the teacher's head start)."""
        teacher, groups = self.pools.teacher, self.teacher_requests_in_flight
        slots = teacher.replicas * teacher.max_ongoing_requests
        if slots >= groups or not self.objective.teacher_scores:
            return None
        return (f"note: the teacher admits {slots} scoring requests at once (pools.teacher.replicas {teacher.replicas} x"
                f" {teacher.max_ongoing_requests}, twice max_batch_size) and {groups} rollout groups can be out"
                f"{' (two updates in flight)' if self.schedule.max_staleness else ''}: the learner ranks send the other"
                f" {groups - slots} as scored groups free slots, so the teacher starts on their prompts only then"
                " (more replicas, a larger max_batch_size or schedule.group_prompts lift it)")

    @property
    def eval_budget_bps(self) -> int:
        """The budget every evaluation of the student runs at: `eval.budget_bps`, else the curriculum's target."""
        return self.eval.budget_bps or self.budget.target_bps

    @model_validator(mode="after")
    def _prompt_scope_on_transformers(self) -> JobConfig:
        if self.selector.scope != "image" and "vllm" in (self.pools.rollout.backend, self.pools.teacher.backend):
            raise ValueError(f"selector.scope {self.selector.scope} selects across a prompt's images or frames in the transformers engines;"
                             " vLLM's plugin selects per image: set pools.rollout.backend and pools.teacher.backend to transformers")
        return self

    @model_validator(mode="after")
    def _fastv_evaluated_in_transformers(self) -> JobConfig:
        if "fastv" in self.eval.selectors and self.selector.merge == "learnable":
            raise ValueError("eval.selectors fastv prunes inside the language model, where selector.merge learnable has no discarded"
                             " tokens to take in: evaluate this student with selectors that prune before it")
        if "fastv" in self.eval.selectors and self.pools.rollout.backend == "vllm":
            raise ValueError("eval.selectors fastv prunes inside the language model, which vLLM's model runner does not; the rollout"
                             " workers evaluate: set pools.rollout.backend to transformers, or score FastV with lt-opd eval")
        return self

    @model_validator(mode="after")
    def _vllm_samples_the_students_own(self) -> JobConfig:
        if self.pools.rollout.backend == "vllm" and self.objective.prefixes != "student":
            raise ValueError(f"objective.mode {self.objective.mode} trains on responses the student does not sample (the"
                             f" {self.objective.prefixes}'s), which a rollout worker reads with the student's transformers"
                             " forward: set pools.rollout.backend: transformers")
        return self

    @model_validator(mode="after")
    def _rewarded_groups(self) -> JobConfig:
        if self.objective.policy_gradient and self.reward.name is None:
            raise ValueError(f"objective.mode {self.objective.mode} trains on rewards: set reward.name (answer, answer_normalised, choice,"
                             " format, or module:function)")
        if (self.reward.name == JUDGE_REWARD) != (self.reward.judge is not None):
            raise ValueError("reward.name judge asks the judge model reward.judge: set both, or neither")
        if self.reward.overlong_buffer and self.reward.name is None:
            raise ValueError("reward.overlong_buffer shapes a reward: set reward.name")
        if self.reward.dynamic_sampling_rounds and not self.objective.policy_gradient:
            raise ValueError(f"reward.dynamic_sampling_rounds replaces prompts whose rewards give no advantage: objective.mode"
                             f" {self.objective.mode} takes no advantage (grpo, dapo, gspo do)")
        if self.reward.dynamic_sampling_rounds and self.schedule.group_prompts != 1:
            raise ValueError(f"reward.dynamic_sampling_rounds replaces one prompt's group at a time: set schedule.group_prompts to 1"
                             f" (it is {self.schedule.group_prompts})")
        if self.reward.overlong_buffer > self.sampling.max_new_tokens:
            raise ValueError(f"reward.overlong_buffer ({self.reward.overlong_buffer}) is longer than sampling.max_new_tokens"
                             f" ({self.sampling.max_new_tokens})")
        if self.objective.policy_gradient and (self.sampling.temperature != 1.0 or self.sampling.top_p != 1.0):
            raise ValueError(f"objective.mode {self.objective.mode} takes the learner's log-probs of the untempered, untruncated"
                             " policy as the policy that sampled: set sampling.temperature and sampling.top_p to 1")
        if self.optimizer.steps_per_update * self.pools.learner.ranks > self.sampling.prompts_per_step:
            raise ValueError(f"optimizer.steps_per_update ({self.optimizer.steps_per_update}) splits each of the"
                             f" {self.pools.learner.ranks} learner ranks' prompts into as many mini-batches: sampling.prompts_per_step"
                             f" ({self.sampling.prompts_per_step}) must be at least their product")
        if self.objective.policy_gradient and self.sampling.n < 2:
            raise ValueError(f"objective.mode {self.objective.mode} compares each response with the others of its prompt: set"
                             f" sampling.n to 2 or more (it is {self.sampling.n})")
        return self

    @model_validator(mode="after")
    def _one_response_per_row(self) -> JobConfig:
        if self.objective.prefixes == "dataset" and self.sampling.n != 1:
            raise ValueError(f"objective.mode {self.objective.mode} trains on the one response each row carries: set sampling.n to 1"
                             f" (it is {self.sampling.n})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _run_folder_of_the_job(cls, data):
        """checkpoint.dir defaults to runs/<job name>: jobs of other names never share a folder."""
        if isinstance(data, dict) and isinstance(data.get("checkpoint", {}), dict) and data.get("checkpoint", {}).get("dir") is None:
            data = {**data, "checkpoint": {**data.get("checkpoint", {}), "dir": f"runs/{data.get('name', 'lt-opd')}"}}
        return data
