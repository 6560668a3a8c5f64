"""One update as the driver reports it: the learner ranks' results, the phases' seconds from every span of the
update's work, and the pools' busy fractions (what the CLI prints, `steps.jsonl` keeps and the trackers plot)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lt_opd_ray.core.wire import LearnerStepResult, PhaseTimes, Span, busy_seconds


@dataclass
class StepLog:
    step: int
    budget_bps: int
    loss: float
    divergence: float | None  # None (and top_k_overlap) where the job has no teacher: nothing to compare with
    importance_weight: float
    top_k_overlap: float | None
    tokens: int
    grad_norm: float = 0.0  # global gradient norm before clipping
    staleness: int = 0  # learner version - the oldest sampling version of this update's rollouts
    phases: PhaseTimes = field(default_factory=PhaseTimes)
    sync_bytes: int = 0
    payload_bytes_per_token: float = 0.0
    sequences: int = 0  # rollouts trained on, over all ranks
    micro_batches: int = 0  # learner forward/backward passes with sequences, over all ranks
    filler_micro_batches: int = 0  # zero-weighted passes that keep the ranks' backward counts equal
    vision_forwards: int = 0  # learner vision-tower passes: one per prompt when its group fits a micro-batch
    response_tokens_mean: float = 0.0  # tokens per response
    response_tokens_max: int = 0
    truncated_share: float = 0.0  # of the responses, those cut at sampling.max_new_tokens
    clipped_share: float = 0.0  # of the response positions, those whose importance weight was cut to the clip
    logprob_gap: float = 0.0  # mean |learner's - rollout engine's log-prob| of the sampled tokens: ~0 on policy unless the engines disagree
    padding_share: float = 0.0  # of the positions the learners' forwards computed (rows x longest per micro-batch), those that were padding
    reward_mean: float | None = None  # mean reward.name score of the update's responses; None: the job has no reward
    reward_std: float | None = None  # their standard deviation (population)
    resampled_groups: int | None = None  # dynamic sampling: flat groups given to drawn rows (one per place per round); None: off
    flat_groups: int | None = None  # dynamic sampling: groups still all equal after the last round, left out of the step
    sequence_lengths: list[list[list[int]]] = field(default_factory=list)  # per rank, per prompt in the order packed: tokens per sequence
    eval_accuracy: dict[str, float] = field(default_factory=dict)  # selector -> accuracy, on evaluated steps
    eval_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)  # selector -> kind of question -> accuracy, where rows carry kinds
    eval_scores: dict[str, float] = field(default_factory=dict)  # "benchmark[selector]" -> score, on evaluated steps
    timeline: list[Span] = field(default_factory=list)  # every piece of this update's work (`lt-opd timeline` draws it)


def summarize(
    update: int, budget_bps: int, ranks: list[LearnerStepResult], rollout_spans: list[Span], spans: list[Span],
    sizes: dict[str, int], period: float, sync_bytes: int, accuracy: dict[str, float], scores: dict[str, float],
    rewards: list[float] | None = None, by_kind: dict[str, dict[str, float]] | None = None,
) -> StepLog:
    """The update's StepLog: `spans` are the driver's own (sync, checkpoint, eval), `sizes` each pool's actors,
    `period` the seconds since the previous update ended and `rewards` the responses' rewards (the job has one)."""
    teacher_spans = list(dict.fromkeys(s for r in ranks for s in r.spans if s.role == "teacher"))  # each once
    learner_spans = [s for r in ranks for s in r.spans if s.role == "learner"]

    def extent(chosen: list[Span]) -> float:
        return max(s.end for s in chosen) - min(s.start for s in chosen) if chosen else 0.0

    def of(role: str) -> float:
        return sum(s.seconds for s in spans if s.role == role)

    busy = {  # an actor's overlapping spans (groups sampled or scored in one batch) count once
        "rollout": busy_seconds(rollout_spans) / (sizes["rollout"] * period),
        "teacher": busy_seconds(teacher_spans) / (max(sizes["teacher"], 1) * period),
        "learner": busy_seconds(learner_spans) / (sizes["learner"] * period),
    }
    phases = PhaseTimes(
        rollout=extent(rollout_spans), teacher=extent(teacher_spans), learner=max(r.seconds for r in ranks),
        sync=of("sync"), checkpoint=of("checkpoint"), eval=of("eval"), step=period, busy=busy,
    )

    def total(key: str):
        return sum(getattr(r, key) for r in ranks)

    def by_tokens(key: str) -> float | None:  # None: what compares with a teacher the job lacks
        if any(getattr(r, key) is None for r in ranks):
            return None
        return sum(getattr(r, key) * r.tokens for r in ranks) / max(total("tokens"), 1)

    real_tokens = sum(n for r in ranks for prompt in r.sequence_lengths for n in prompt)  # the micro-batches' sequences' own tokens

    return StepLog(
        step=update,
        budget_bps=budget_bps,
        loss=total("loss") / len(ranks),  # each rank's loss is its Σ over sequences / (N / ranks)
        divergence=by_tokens("divergence"),
        importance_weight=by_tokens("importance_weight"),
        top_k_overlap=by_tokens("top_k_overlap"),
        tokens=total("tokens"),
        grad_norm=ranks[0].grad_norm,  # global: the same on every rank
        staleness=max(r.staleness for r in ranks),
        phases=phases,
        sync_bytes=sync_bytes,
        payload_bytes_per_token=total("payload_bytes") / max(total("payload_tokens"), 1),
        sequences=total("sequences"),
        micro_batches=total("micro_batches"),
        filler_micro_batches=total("filler_micro_batches"),
        vision_forwards=total("vision_forwards"),
        response_tokens_mean=total("tokens") / max(total("sequences"), 1),
        response_tokens_max=max(r.longest_response for r in ranks),
        truncated_share=total("truncated_sequences") / max(total("sequences"), 1),
        clipped_share=by_tokens("clipped_share"),
        logprob_gap=by_tokens("logprob_gap"),
        padding_share=1 - real_tokens / total("computed_tokens") if total("computed_tokens") else 0.0,
        reward_mean=statistics.fmean(rewards) if rewards else None,
        reward_std=statistics.pstdev(rewards) if rewards else None,
        sequence_lengths=[[list(prompt) for prompt in r.sequence_lengths] for r in ranks],
        eval_accuracy=accuracy,
        eval_by_kind=by_kind or {},
        eval_scores=scores,
        timeline=sorted([*rollout_spans, *teacher_spans, *learner_spans, *spans], key=lambda s: s.start),
    )
