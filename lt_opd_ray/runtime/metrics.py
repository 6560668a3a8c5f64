"""Metrics each role exports through ray.util.metrics (scraped as `ray_lt_opd_*` from the node's endpoint).

Every series carries the job name and the role's actor name as tags, so the
dashboards can filter one run and split by worker.
"""

from __future__ import annotations

from ray.util import metrics

TAGS = ("job", "actor")


def _gauge(name: str, description: str):
    return metrics.Gauge(f"lt_opd_{name}", description=description, tag_keys=TAGS)


def _counter(name: str, description: str):
    return metrics.Counter(f"lt_opd_{name}", description=description, tag_keys=TAGS)


class RolloutMetrics:
    def __init__(self, job: str, actor: str):
        self.tags = {"job": job, "actor": actor}
        self.tokens_per_s = _gauge("rollout_tokens_per_second", "Response tokens sampled per second by a rollout worker")
        self.tokens = _counter("rollout_tokens", "Response tokens sampled")
        self.budget = _gauge("rollout_budget_bps", "Visual budget of the last rollout, basis points")

    def record(self, tokens: int, seconds: float, budget_bps: int) -> None:
        self.tokens_per_s.set(tokens / max(seconds, 1e-9), tags=self.tags)
        self.tokens.inc(tokens, tags=self.tags)
        self.budget.set(budget_bps, tags=self.tags)


class TeacherMetrics:
    def __init__(self, job: str, actor: str):
        self.tags = {"job": job, "actor": actor}
        self.tokens_per_s = _gauge("teacher_tokens_per_second", "Response positions scored per second by a teacher replica")
        self.tokens = _counter("teacher_tokens", "Response positions scored")
        self.payload_bytes_per_token = _gauge("teacher_payload_bytes_per_token", "Teacher payload bytes per scored position")

    def record(self, tokens: int, seconds: float, payload_bytes: int) -> None:
        self.tokens_per_s.set(tokens / max(seconds, 1e-9), tags=self.tags)
        self.tokens.inc(tokens, tags=self.tags)
        self.payload_bytes_per_token.set(payload_bytes / max(tokens, 1), tags=self.tags)


class LearnerMetrics:
    def __init__(self, job: str, actor: str):
        self.tags = {"job": job, "actor": actor}
        self.step_seconds = _gauge("learner_step_seconds", "Seconds of one learner step (forward, backward, optimizer)")
        self.loss = _gauge("loss", "LT-OPD loss of the last step on this rank")
        self.divergence = _gauge("divergence", "Token-mean divergence of the last step")
        self.importance_weight = _gauge("importance_weight", "Token-mean truncated importance weight")
        self.overlap = _gauge("topk_overlap", "Mean fraction of the teacher's top-k inside the student's top-k")
        self.sync_seconds = _gauge("weight_sync_seconds", "Seconds of the last weight broadcast")
        self.sync_bytes = _counter("weight_sync_bytes", "Bytes broadcast to rollout workers")

    def record_step(self, stats: dict, seconds: float) -> None:
        self.step_seconds.set(seconds, tags=self.tags)
        self.loss.set(stats["loss"], tags=self.tags)
        self.divergence.set(stats["divergence"], tags=self.tags)
        self.importance_weight.set(stats["importance_weight"], tags=self.tags)
        self.overlap.set(stats["top_k_overlap"], tags=self.tags)

    def record_sync(self, seconds: float, nbytes: int) -> None:
        self.sync_seconds.set(seconds, tags=self.tags)
        self.sync_bytes.inc(nbytes, tags=self.tags)


class DriverMetrics:
    def __init__(self, job: str):
        self.tags = {"job": job, "actor": "driver"}
        self.step = _gauge("step", "Optimizer steps completed")
        self.budget = _gauge("budget_bps", "Visual budget of the current update, basis points")
        self.phase_seconds = metrics.Gauge(
            "lt_opd_phase_seconds", description="Seconds of each phase of the last step", tag_keys=(*TAGS, "phase")
        )
        self.restarts = _counter("actor_restarts", "Actors replaced after a failure")

    def record(self, step: int, budget_bps: int, phases: dict[str, float]) -> None:
        self.step.set(step, tags=self.tags)
        self.budget.set(budget_bps, tags=self.tags)
        for phase, seconds in phases.items():
            self.phase_seconds.set(seconds, tags={**self.tags, "phase": phase})
