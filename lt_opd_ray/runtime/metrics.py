"""Metrics each role exports through ray.util.metrics (scraped as `ray_lt_opd_*` from the node's endpoint).

Every series carries the job name (as `run`) and the role's actor name as tags,
so the dashboards can filter one run and split by worker.
"""

from __future__ import annotations

from ray.util import metrics

TAGS = ("run", "actor")  # not "job": Prometheus owns that label for its scrape job


def _gauge(name: str, description: str):
    return metrics.Gauge(f"lt_opd_{name}", description=description, tag_keys=TAGS)


def _counter(name: str, description: str):
    return metrics.Counter(f"lt_opd_{name}", description=description, tag_keys=TAGS)


class RolloutMetrics:
    def __init__(self, job: str, actor: str):
        self.tags = {"run": job, "actor": actor}
        self.tokens_per_s = _gauge("rollout_tokens_per_second", "Response tokens sampled per second by a rollout worker")
        self.tokens = _counter("rollout_tokens", "Response tokens sampled")
        self.budget = _gauge("rollout_budget_bps", "Visual budget of the last rollout, basis points")

    def record(self, tokens: int, seconds: float, budget_bps: int) -> None:
        self.tokens_per_s.set(tokens / max(seconds, 1e-9), tags=self.tags)
        self.tokens.inc(tokens, tags=self.tags)
        self.budget.set(budget_bps, tags=self.tags)


class TeacherMetrics:
    def __init__(self, job: str, actor: str):
        self.tags = {"run": job, "actor": actor}
        self.tokens_per_s = _gauge("teacher_tokens_per_second", "Response positions scored per second by a teacher replica")
        self.tokens = _counter("teacher_tokens", "Response positions scored")
        self.payload_bytes_per_token = _gauge("teacher_payload_bytes_per_token", "Teacher payload bytes per scored position")

    def record(self, tokens: int, seconds: float, payload_bytes: int) -> None:
        self.tokens_per_s.set(tokens / max(seconds, 1e-9), tags=self.tags)
        self.tokens.inc(tokens, tags=self.tags)
        self.payload_bytes_per_token.set(payload_bytes / max(tokens, 1), tags=self.tags)


class LearnerMetrics:
    def __init__(self, job: str, actor: str):
        self.tags = {"run": job, "actor": actor}
        self.step_seconds = _gauge("learner_step_seconds", "Seconds of one learner step (forward, backward, optimizer)")
        self.loss = _gauge("loss", "LT-OPD loss of the last step on this rank")
        self.divergence = _gauge("divergence", "Token-mean divergence of the last step")
        self.importance_weight = _gauge("importance_weight", "Token-mean truncated importance weight")
        self.overlap = _gauge("topk_overlap", "Mean fraction of the teacher's top-k inside the student's top-k")
        self.clipped = _gauge("importance_clipped_share", "Share of response positions whose importance weight was cut to the clip")
        self.logprob_gap = _gauge("logprob_gap", "Mean |learner's - rollout engine's log-prob| of the sampled tokens")
        self.response_tokens = metrics.Gauge("lt_opd_response_tokens", description="Response length of the last step on this rank",
                                             tag_keys=(*TAGS, "stat"))
        self.truncated = _gauge("truncated_share", "Share of the last step's responses cut at sampling.max_new_tokens")
        self.sync_seconds = _gauge("weight_sync_seconds", "Seconds of the last weight broadcast")
        self.sync_bytes = _counter("weight_sync_bytes", "Bytes broadcast to rollout workers")

    def record_step(self, result) -> None:
        """One rank's `wire.LearnerStepResult`."""
        self.step_seconds.set(result.seconds, tags=self.tags)
        self.loss.set(result.loss, tags=self.tags)
        if result.divergence is not None:  # None (and the overlap) where the job has no teacher
            self.divergence.set(result.divergence, tags=self.tags)
            self.overlap.set(result.top_k_overlap, tags=self.tags)
        self.importance_weight.set(result.importance_weight, tags=self.tags)
        self.clipped.set(result.clipped_share, tags=self.tags)
        self.logprob_gap.set(result.logprob_gap, tags=self.tags)
        self.response_tokens.set(result.tokens / max(result.sequences, 1), tags={**self.tags, "stat": "mean"})
        self.response_tokens.set(result.longest_response, tags={**self.tags, "stat": "max"})
        self.truncated.set(result.truncated_sequences / max(result.sequences, 1), tags=self.tags)

    def record_sync(self, seconds: float, nbytes: int) -> None:
        self.sync_seconds.set(seconds, tags=self.tags)
        self.sync_bytes.inc(nbytes, tags=self.tags)


class DriverMetrics:
    def __init__(self, job: str):
        self.tags = {"run": job, "actor": "driver"}
        self.step = _gauge("step", "Optimizer steps completed")
        self.budget = _gauge("budget_bps", "Visual budget of the current update, basis points")
        self.phase_seconds = metrics.Gauge(
            "lt_opd_phase_seconds", description="Seconds of each phase of the last step", tag_keys=(*TAGS, "phase")
        )
        self.samples = _counter("learner_samples", "Rollouts (sampled responses) the learners trained on")
        self.staleness = _gauge("staleness", "Weight versions between the learner and the rollouts it trained on (largest in the update)")
        self.reward = _gauge("reward_mean", "Mean reward (reward.name) of the last update's responses")
        self.reward_std = _gauge("reward_std", "Standard deviation of the last update's rewards, over its responses")
        self.resampled = _gauge("resampled_groups", "Rollout groups of the last update whose rewards were all equal, given to drawn rows"
                                " (dynamic sampling: one per prompt place per round; 0 where it is off)")
        self.flat = _gauge("flat_groups", "Rollout groups of the last update still all equal after dynamic sampling's last round")
        self.pool_busy = metrics.Gauge(
            "lt_opd_pool_busy_fraction", description="Busy seconds of a pool's actors / (actors x seconds per update)", tag_keys=(*TAGS, "pool")
        )
        self.pool_actors = metrics.Gauge("lt_opd_pool_actors", description="Actors per pool", tag_keys=(*TAGS, "pool"))
        self.restarts = metrics.Gauge(
            "lt_opd_actor_restarts", description="Actors replaced after a failure in this run, per pool", tag_keys=(*TAGS, "pool")
        )
        self.restart_counts: dict[str, int] = {}
        self.eval_accuracy = metrics.Gauge(
            "lt_opd_eval_accuracy",
            description="Answer accuracy of the student at the evaluation budget, per selector",
            tag_keys=(*TAGS, "selector", "budget_bps"),
        )
        self.eval_score = metrics.Gauge(
            "lt_opd_eval_score",
            description="Benchmark score of the student at the evaluation budget (each benchmark's own metric), per selector",
            tag_keys=(*TAGS, "benchmark", "selector", "budget_bps"),
        )

    def record(self, step: int, budget_bps: int, phases, samples: int, pool_sizes: dict[str, int], staleness: int,
               reward: tuple[float, float, int, int] | None = None) -> None:
        """`phases`: the update's `wire.PhaseTimes`; `reward` where the job has one: the rewards' mean and standard
        deviation, the groups dynamic sampling replaced and kept flat."""
        self.step.set(step, tags=self.tags)
        if reward is not None:
            for gauge, value in zip((self.reward, self.reward_std, self.resampled, self.flat), reward):
                gauge.set(value, tags=self.tags)
        self.budget.set(budget_bps, tags=self.tags)
        self.samples.inc(samples, tags=self.tags)
        self.staleness.set(staleness, tags=self.tags)
        for phase, seconds in vars(phases).items():
            if phase != "busy":
                self.phase_seconds.set(seconds, tags={**self.tags, "phase": phase})
        for pool, fraction in phases.busy.items():
            self.pool_busy.set(fraction, tags={**self.tags, "pool": pool})
        for pool, size in pool_sizes.items():
            self.pool_actors.set(size, tags={**self.tags, "pool": pool})
            self.restarts.set(self.restart_counts.get(pool, 0), tags={**self.tags, "pool": pool})

    def record_eval(self, budget_bps: int, accuracy: dict[str, float]) -> None:
        for selector, value in accuracy.items():
            self.eval_accuracy.set(value, tags={**self.tags, "selector": selector, "budget_bps": str(budget_bps)})

    def record_benchmarks(self, budget_bps: int, results: list) -> None:
        """`results`: `wire.BenchmarkResult`s."""
        for r in results:
            tags = {**self.tags, "benchmark": r.benchmark, "selector": r.selector, "budget_bps": str(budget_bps)}
            self.eval_score.set(r.score, tags=tags)

    def record_restart(self, pool: str) -> None:
        self.restart_counts[pool] = self.restart_counts.get(pool, 0) + 1
