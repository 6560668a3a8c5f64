"""Everything that crosses a role boundary, as typed records both sides import (docs/architecture.md §3).

rollout worker --RolloutGroup--> teacher --TeacherPayload--> learner --LearnerStepResult--> driver
learner rank 0 --weights--> rollout workers, reported as SyncResult; every piece of work carries a Span.

This module imports no role, so engines, the teacher and the learner can share it
without importing each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class Span:
    """One piece of work of one actor, in wall-clock seconds since the epoch (for the timeline)."""

    role: str  # rollout | teacher | learner | sync | checkpoint | eval
    actor: str
    what: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def busy_seconds(spans, start: float = float("-inf"), end: float = float("inf")) -> float:
    """Seconds the spans' actors were busy within [start, end], summed over actors: an actor's overlapping spans
    (the groups of one rollout batch, a vLLM worker's groups sharing its engine, a teacher batch) count once."""
    total = 0.0
    for actor in {s.actor for s in spans}:
        reach = start  # how far this actor's busy time is counted
        for span in sorted((s for s in spans if s.actor == actor), key=lambda s: s.start):
            begin, stop = max(span.start, reach), min(span.end, end)
            if stop > begin:
                total += stop - begin
                reach = stop
    return total


class Stopwatch:
    """`with Stopwatch() as watch: ...` then `watch.span(role, actor, what)`."""

    def __enter__(self) -> Stopwatch:
        self.start = time.time()
        return self

    def __exit__(self, *exc) -> None:
        self.end = time.time()

    def span(self, role: str, actor: str, what: str) -> Span:
        return Span(role, actor, what, self.start, self.end)


@dataclass
class Rollout:
    """One sampled response of the student at budget r; everything the learner replays."""

    prompt_index: int  # index into the update's prompt list
    response_ids: torch.Tensor  # [T] long
    old_logp: torch.Tensor  # [T] fp32, sampled token under the rollout (behaviour) policy
    student_top_ids: torch.Tensor  # [T, k] int32 (`token_ids32`): the largest field a rollout carries to teacher and learner
    selected: list[torch.Tensor]  # per visual unit (an image, a clip's temporal patch): kept visual-token indices (sorted)
    budget_bps: int
    finish_reason: str
    merge_routes: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per visual unit (assignment, prior): selector.merge learnable
    reward: float | None = None  # reward.name's score of the response, given by the worker that sampled it; None: no reward

    @classmethod
    def sampled(cls, prompt_index: int, completion, selected, merge_routes, budget_bps: int) -> Rollout:
        """From either backend's completion (token_ids, logprobs, top_ids, finish_reason) and the prompt's selection."""
        if completion.logprobs is None:
            raise ValueError("a rollout carries its tokens' log-probs: sample it with top_k_logprobs 0 or more, not None")
        return cls(
            prompt_index=prompt_index,
            response_ids=completion.token_ids,
            old_logp=completion.logprobs,
            student_top_ids=token_ids32(completion.top_ids),
            selected=selected,
            merge_routes=merge_routes,
            budget_bps=budget_bps,
            finish_reason=completion.finish_reason,
        )


def token_ids32(ids: torch.Tensor) -> torch.Tensor:
    """Token ids as int32, half of int64's bytes on the wire (k = 100: 400 B per response position instead of 800);
    an id int32 cannot hold is refused, not wrapped."""
    if ids.numel() and int(ids.max()) > torch.iinfo(torch.int32).max:
        raise ValueError(f"token id {int(ids.max())} does not fit int32: a vocabulary over 2^31 - 1 ids")
    return ids.to(torch.int32)


@dataclass
class TeacherScore:
    """The frozen teacher's view of one rollout, on the full-token prompt."""

    top_ids: torch.Tensor  # [T, k] int32
    top_logp: torch.Tensor  # [T, k]
    requested_logp: torch.Tensor  # [T, k + 1]: at the student's top-k ids, then at the sampled token


@dataclass
class RolloutGroup:
    """The n responses of each prompt in [start, stop) of one update, sampled by one worker: the unit that streams.

    A group never spans two learner ranks' prompt ranges, so it has exactly one destination.
    """

    update: int  # the optimizer step this group is trained in
    start: int  # first prompt, as an index into the update's prompt list
    stop: int
    learner_rank: int
    rollouts: list[Rollout]  # prompt_index is global (start already added)
    worker: str
    weights_version: int | None  # the student weights that sampled it (None: the worker's weights were torn)
    span: Span

    @property
    def tokens(self) -> int:
        return sum(r.response_ids.numel() for r in self.rollouts)

    def summary(self) -> RolloutSummary:
        return RolloutSummary(self.tokens, self.span, tuple(r.reward for r in self.rollouts if r.reward is not None))


@dataclass(frozen=True)
class RolloutSummary:
    """What the driver reads of a RolloutGroup (returned beside it), without the bulk data."""

    tokens: int
    span: Span
    rewards: tuple[float, ...] = ()  # per rollout in group order, where the job has a reward


@dataclass(frozen=True)
class TeacherRun:
    """The run a teacher request belongs to. Runs on one Serve app count up from 0: an app kept for a later run
    (runtime/kept_roles.py) serves run 1, 2, ..., and a replica builds the later run's teacher from `job_ref` (an
    ObjectRef of its JobConfig) on that run's first call, and refuses an earlier run's requests."""

    ordinal: int
    job_ref: object


@dataclass(frozen=True)
class ScoringRequest:
    """What a learner rank needs to ask the teacher to score its groups of an update: the Serve app, the update's
    samples (an ObjectRef), and the run they belong to."""

    app: str
    samples_ref: object
    run: TeacherRun


class MalformedPayloadError(ValueError):
    pass


@dataclass
class TeacherPayload:
    """The teacher's answer for one RolloutGroup: int32 ids and fp16/fp32 log-probs, one row per response position."""

    lengths: np.ndarray  # [S] int32: response positions per rollout, in group order
    top_ids: np.ndarray  # [ΣT, k] int32
    top_logp: np.ndarray  # [ΣT, k] fp16 or fp32
    requested_logp: np.ndarray  # [ΣT, k_student + 1]: at the student's top-k ids, then the sampled token
    spans: tuple[Span, ...] = ()  # the replica's work on this group: its head start (when it had one), then its scoring
    replica: str = ""

    @property
    def nbytes(self) -> int:
        return self.lengths.nbytes + self.top_ids.nbytes + self.top_logp.nbytes + self.requested_logp.nbytes

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / max(int(self.lengths.sum()), 1)


def payload_bytes_per_position(top_k: int, value_dtype: str) -> int:
    """A TeacherPayload's bytes per response position: top-k int32 ids, their log-probs, and the log-probs at the
    student's top-k ids plus the sampled token."""
    value = 2 if value_dtype == "float16" else 4
    return top_k * 4 + top_k * value + (top_k + 1) * value


def pack_scores(scores: list[TeacherScore], value_dtype: str) -> TeacherPayload:
    dtype = np.float16 if value_dtype == "float16" else np.float32
    return TeacherPayload(
        lengths=np.array([s.top_ids.shape[0] for s in scores], dtype=np.int32),
        top_ids=np.concatenate([s.top_ids.numpy().astype(np.int32) for s in scores]),
        top_logp=np.concatenate([s.top_logp.numpy() for s in scores]).astype(dtype),
        requested_logp=np.concatenate([s.requested_logp.numpy() for s in scores]).astype(dtype),
    )


def unpack_scores(payload: TeacherPayload, rollouts: list[Rollout], vocab_size: int, source: str = "teacher") -> list[TeacherScore]:
    """Check a payload against the rollouts it answers, then split it per rollout."""

    def fail(reason: str):
        raise MalformedPayloadError(f"malformed teacher payload from {source}: {reason}")

    if not isinstance(payload, TeacherPayload):
        fail(f"expected a TeacherPayload, got {type(payload).__name__}")
    lengths = np.asarray(payload.lengths)
    if lengths.shape != (len(rollouts),):
        fail(f"{lengths.shape[0] if lengths.ndim else 0} lengths for {len(rollouts)} rollouts")
    expected = [r.response_ids.numel() for r in rollouts]
    if lengths.tolist() != expected:
        bad = next(i for i, (a, b) in enumerate(zip(lengths.tolist(), expected)) if a != b)
        fail(f"rollout {bad} has {expected[bad]} response tokens but the payload has {int(lengths[bad])}")
    total = int(lengths.sum())
    k_student = rollouts[0].student_top_ids.shape[1] if rollouts else 0
    if payload.top_ids.dtype != np.int32:
        fail(f"top_ids must be int32, got {payload.top_ids.dtype}")
    if payload.top_ids.ndim != 2 or payload.top_ids.shape[0] != total or payload.top_logp.shape != payload.top_ids.shape:
        fail(f"top_ids {payload.top_ids.shape} / top_logp {payload.top_logp.shape} do not match {total} positions")
    if payload.requested_logp.shape != (total, k_student + 1):
        fail(f"requested_logp has shape {payload.requested_logp.shape}, expected {(total, k_student + 1)}")
    if total and (payload.top_ids.min() < 0 or payload.top_ids.max() >= vocab_size):
        fail(f"top_ids outside the vocabulary [0, {vocab_size})")
    for name in ("top_logp", "requested_logp"):
        values = getattr(payload, name)
        if values.dtype not in (np.float16, np.float32):
            fail(f"{name} must be fp16 or fp32, got {values.dtype}")
        if not np.all(np.isfinite(values)) or np.any(values > 1e-3):
            fail(f"{name} holds values that are not log-probabilities (non-finite or > 0)")
    scores, offset = [], 0
    for n in lengths.tolist():
        rows = slice(offset, offset + n)
        scores.append(
            TeacherScore(
                top_ids=torch.from_numpy(payload.top_ids[rows].copy()),
                top_logp=torch.from_numpy(payload.top_logp[rows].astype(np.float32)),
                requested_logp=torch.from_numpy(payload.requested_logp[rows].astype(np.float32)),
            )
        )
        offset += n
    return scores


class StaleRolloutError(RuntimeError):
    """A rollout group sampled by weights older than `schedule.max_staleness` allows."""


@dataclass(frozen=True)
class LearnerStepResult:
    """One learner rank's part of an update's optimizer step."""

    loss: float  # Σ over this rank's sequences of their token-mean loss / (N / ranks): the mean over ranks is the update's loss
    divergence: float | None  # token-mean over this rank's tokens; None (and top_k_overlap) where the job has no teacher
    importance_weight: float  # token-mean
    top_k_overlap: float | None  # token-mean
    tokens: int
    sequences: int
    prompts: int
    micro_batches: int  # forward/backward passes with sequences
    filler_micro_batches: int  # zero-weighted passes that keep the ranks' backward counts equal
    vision_forwards: int
    grad_norm: float  # global, before clipping: the same on every rank
    staleness: int = 0  # largest (learner version - sampling version) over this rank's groups
    seconds: float = 0.0  # compute only, not the waits for rollouts and payloads
    payload_bytes: int = 0
    payload_tokens: int = 0
    teacher_retries: int = 0  # scoring requests sent again because the replica serving them died
    clipped_share: float = 0.0  # token-mean share of importance weights cut to the clip
    logprob_gap: float = 0.0  # token-mean |learner's - rollout engine's log-prob| of the sampled token
    truncated_sequences: int = 0  # responses cut at sampling.max_new_tokens
    longest_response: int = 0  # tokens
    sequence_lengths: tuple[tuple[int, ...], ...] = ()  # per prompt, in the order packed: its sequences' tokens (reduced prompt + response)
    computed_tokens: int = 0  # Σ over its micro-batches of the positions its forwards computed (rows x longest padded, the tokens packed)
    spans: tuple[Span, ...] = ()  # this rank's groups' rollout and scoring spans, then its micro-batches


@dataclass(frozen=True)
class WeightsSent:
    """A learner rank's part of a weight broadcast (rank 0 sends; the others take part in ZeRO-3 gathers)."""

    rank: int
    bytes: int
    dtype: str
    seconds: float


@dataclass(frozen=True)
class WeightsReceived:
    """A rollout worker's side of a weight broadcast: the version its engine now holds."""

    worker: str
    version: int
    seconds: float


@dataclass(frozen=True)
class SyncResult:
    """One weight broadcast, learner rank 0 -> every rollout worker."""

    version: int
    bytes: int
    dtype: str
    seconds: float


@dataclass(frozen=True)
class ActorPlacement:
    """Where Ray placed one actor: its node and the GPU ids it was given (CUDA_VISIBLE_DEVICES holds exactly
    those, so inside the actor its GPU is cuda:0)."""

    actor: str
    node: str
    gpus: tuple[str, ...]
    engine: str  # what computes in it: "transformers", "vLLM V2 runner", "DeepSpeed ZeRO-3", ...
    missing_kernels: tuple[str, ...] = ()  # fast-kernel packages its model falls back from here (models/kernels.py)


@dataclass(frozen=True)
class EvalResult:
    """Greedy answer accuracy of a rollout worker's current student at a budget with one selector."""

    selector: str
    budget_bps: int
    accuracy: float
    weights_version: int | None
    by_kind: dict[str, float] = field(default_factory=dict)  # accuracy on the rows of each kind of question (Sample.kind); {} where none has one


@dataclass(frozen=True)
class BenchmarkResult:
    """One benchmark's own score of a rollout worker's current student at a budget with one selector."""

    benchmark: str
    selector: str
    score: float
    weights_version: int | None


@dataclass
class PhaseTimes:
    """Seconds of one update by phase. Rollout and teacher are the wall extent of this update's groups (which,
    with max_staleness 1, overlap the previous update's learner step; the teacher's from its head start on the
    first group's prompts, while they are sampled, to its last scoring); `step` is the time between the ends of
    consecutive updates: what an update costs in throughput."""

    rollout: float = 0.0
    teacher: float = 0.0
    learner: float = 0.0
    sync: float = 0.0
    checkpoint: float = 0.0
    eval: float = 0.0
    step: float = 0.0
    busy: dict[str, float] = field(default_factory=dict)  # pool -> this update's busy seconds / (actors x step): its work per
    # unit of throughput; above 1 while a staleness-1 pipeline fills (`timeline.window_busy` attributes by wall window)
