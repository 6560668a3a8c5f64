"""The driver: the LT-OPD update loop over the four Ray roles (docs/architecture.md §2).

    budget = curriculum(step) -> rollouts -> teacher scores -> learner update
           -> weight sync -> metrics -> checkpoint

It passes ObjectRefs between the roles; rollouts and teacher payloads never
travel through this process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

from ..config import JobConfig
from ..curriculum import BudgetSchedule
from ..data import load_samples
from ..evals.benchmarks import benchmark
from ..models.loading import resolve_model_dir
from ..train_loop import batches
from .checkpoint import CheckpointStore
from .learner_group import LearnerGroup
from .metrics import DriverMetrics
from .resources import check_resources
from .rollout_pool import RolloutPool
from .sync_coordinator import WeightBroadcaster
from .teacher import TeacherService


@dataclass
class StepLog:
    step: int
    budget_bps: int
    loss: float
    divergence: float
    importance_weight: float
    top_k_overlap: float
    tokens: int
    grad_norm: float = 0.0  # global gradient norm before clipping
    phases: dict[str, float] = field(default_factory=dict)
    sync_bytes: int = 0
    payload_bytes_per_token: float = 0.0
    sequences: int = 0  # rollouts trained on, over all ranks
    micro_batches: int = 0  # learner forward/backward passes with sequences, over all ranks
    filler_micro_batches: int = 0  # zero-weighted passes that keep the ranks' backward counts equal
    vision_forwards: int = 0  # learner vision-tower passes: one per prompt when its group fits a micro-batch
    eval_accuracy: dict[str, float] = field(default_factory=dict)  # selector -> accuracy, on evaluated steps
    eval_scores: dict[str, float] = field(default_factory=dict)  # "benchmark[selector]" -> score, on evaluated steps


class Driver:
    def __init__(self, job: JobConfig, resume: bool = False):
        check_resources(job, ray.cluster_resources())  # refuse before any actor starts
        resolve_model_dir(job.model.path)  # build an embedded model (tiny:, toy:) once here, not in every actor at once
        self.job = job
        self.schedule = BudgetSchedule.from_config(job.budget)
        self.samples = load_samples(job.data.path, job.data.image_root, job.seed)
        # benchmark files are read and checked before any actor starts
        benchmarks = {name: benchmark(name).load(path) for name, path in job.eval.benchmarks.items()}
        self.checkpoints = CheckpointStore(job)
        self.rollouts = RolloutPool(job)
        self.teacher = TeacherService(job)
        self.learners = LearnerGroup(job)
        self.sync = WeightBroadcaster(self.learners, self.rollouts, job.pools.learner.sync_timeout_s)
        self.metrics = DriverMetrics(job.name)
        self.step, self.cursor = 0, 0
        if resume and (state := self.checkpoints.restore(self.learners)) is not None:
            self.step, self.cursor = state["step"], state["cursor"]
        self.sync.broadcast(version=self.step)  # workers start from exactly the learners' weights
        self.data = batches(self.samples, job.sampling.prompts_per_step, job.data.shuffle_seed, self.cursor)
        self.eval_ref = ray.put(load_samples(job.eval.data, job.data.image_root, job.seed)) if job.eval.data else None
        self.benchmarks_ref = ray.put(benchmarks) if benchmarks else None

    def run_step(self) -> StepLog:
        t0 = time.perf_counter()
        budget = self.schedule.budget_bps(self.step)  # c = optimizer steps completed before this update
        batch = next(self.data)
        samples_ref = ray.put(batch)
        shards, summary_refs = self.rollouts.async_generate(samples_ref, len(batch), budget, self.step, self.learners.prompt_ranges(len(batch)))
        payload_refs = self.teacher.async_score(samples_ref, [s.shard for s in shards])
        ranks = self.learners.train_step(batch, shards, payload_refs, len(batch) * self.job.sampling.n)  # one optimizer step
        t1 = time.perf_counter()
        self.step += 1
        self.cursor += len(batch)
        sync = self.sync.broadcast(version=self.step)  # before the next rollout
        t2 = time.perf_counter()
        if self.step % self.job.checkpoint.every_steps == 0 or self.step == self.job.budget.total_steps:
            self.checkpoints.save(self.learners, {"step": self.step, "cursor": self.cursor})
        t3 = time.perf_counter()
        accuracy, scores = self.evaluate() if self._evaluates_now() else ({}, {})
        t4 = time.perf_counter()
        phases = {
            "rollout": max(s["seconds"] for s in ray.get(summary_refs)),  # workers run in parallel
            "teacher": max(r.teacher_seconds for r in ranks),
            "learner": max(r.seconds for r in ranks),
            "sync": t2 - t1,
            "checkpoint": t3 - t2,
            "eval": t4 - t3,
        }
        # what the chain rollout -> teacher -> learner took beyond its parts: scheduling, transfers, waits
        phases["driver_overhead"] = max(0.0, (t1 - t0) - phases["rollout"] - phases["teacher"] - phases["learner"])
        phases["step"] = t4 - t0
        pool_sizes = {"rollout": len(self.rollouts.workers), "teacher": self.teacher.replicas(), "learner": len(self.learners.actors)}
        self.metrics.record(self.step, budget, phases, samples=sum(r.sequences for r in ranks), pool_sizes=pool_sizes)
        total = lambda key: sum(getattr(r, key) for r in ranks)  # noqa: E731
        by_tokens = lambda key: sum(getattr(r, key) * r.tokens for r in ranks) / max(total("tokens"), 1)  # noqa: E731
        return StepLog(
            step=self.step - 1,
            budget_bps=budget,
            loss=total("loss") / len(ranks),  # each rank's loss is its Σ over sequences / (N / ranks)
            divergence=by_tokens("divergence"),
            importance_weight=by_tokens("importance_weight"),
            top_k_overlap=by_tokens("top_k_overlap"),
            tokens=total("tokens"),
            grad_norm=ranks[0].grad_norm,  # global: the same on every rank
            phases=phases,
            sync_bytes=sync["bytes"],
            payload_bytes_per_token=total("payload_bytes") / max(total("payload_tokens"), 1),
            sequences=total("sequences"),
            micro_batches=total("micro_batches"),
            filler_micro_batches=total("filler_micro_batches"),
            vision_forwards=total("vision_forwards"),
            eval_accuracy=accuracy,
            eval_scores=scores,
        )

    def _evaluates_now(self) -> bool:
        return self.job.eval.enabled and (self.step % self.job.eval.every_steps == 0 or self.step == self.job.budget.total_steps)

    def evaluate(self) -> tuple[dict[str, float], dict[str, float]]:
        """The current student (just synced to the rollout workers): accuracy per selector, benchmark scores."""
        budget = self.job.eval.budget_bps or self.job.budget.target_bps
        accuracy, scores = {}, {}
        if self.eval_ref is not None:
            results = self.rollouts.evaluate(self.eval_ref, budget, self.job.eval.selectors)
            accuracy = {r["selector"]: r["accuracy"] for r in results}
            self.metrics.record_eval(budget, accuracy)
        if self.benchmarks_ref is not None:
            results = self.rollouts.evaluate_benchmarks(self.benchmarks_ref, list(self.job.eval.benchmarks), budget, self.job.eval.selectors)
            scores = {f"{r['benchmark']}[{r['selector']}]": r["score"] for r in results}
            self.metrics.record_benchmarks(budget, results)
        return accuracy, scores

    def export_student(self, directory) -> None:
        """The current student as a Hugging Face folder (written atomically by learner rank 0)."""
        self.learners.save_pretrained(str(directory))

    def replace_dead_rollout_workers(self) -> list[str]:
        """Replace workers that died, re-form the sync group and give them the current weights."""
        dead = self.rollouts.dead_workers()
        if not dead:
            return []
        for index in dead:
            self.rollouts.replace(index)
            self.metrics.record_restart("rollout")
        self.sync.connect()
        self.sync.broadcast(version=self.step)
        return [self.rollouts.names[i] for i in dead]

    def shutdown(self) -> None:
        self.teacher.shutdown()
        self.learners.shutdown()
        self.rollouts.shutdown()
