"""The rollout pool: N Ray actors, each owning one engine that holds the current student.

`async_generate` splits an update's prompts contiguously over the workers. Each
worker hands back its rollouts cut along the learner ranks' prompt ranges: one
ObjectRef[RolloutShard] per (worker, learner rank) that share prompts, so a learner
rank fetches only its own rollouts. Sampling and selection are seeded by (seed,
step, sample uid, response index), so the rollouts depend on neither the worker
nor the rank count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from ..config import JobConfig
from ..microbatch import split_evenly
from ..update import Rollout


@dataclass
class RolloutShard:
    """The rollouts of a contiguous range of an update's prompts, sampled by one worker."""

    offset: int  # index of this shard's first prompt in the update's sample list
    rollouts: list[Rollout]  # prompt_index is global (offset already added)
    worker: str
    weights_version: int
    seconds: float
    tokens: int


@dataclass(frozen=True)
class ShardRef:
    """Where one RolloutShard lives and which learner rank trains on it."""

    learner_rank: int
    shard: ray.ObjectRef  # ObjectRef[RolloutShard]


class RolloutWorker:
    """Owns one rollout engine (`engines.rollout_engines`: transformers or vLLM) holding the current student,
    and answers generate / evaluate / weight-sync calls."""

    def __init__(self, job: JobConfig, name: str):
        import transformers

        from ..engines.rollout_engines import build_rollout_engine
        from .metrics import RolloutMetrics

        transformers.logging.set_verbosity_error()
        self.job, self.name = job, name
        self.engine = build_rollout_engine(job)
        self.weights_version: int | None = 0  # None while an update is half written
        self.sync = None  # set by join_weight_sync
        self.metrics = RolloutMetrics(job.name, name)

    def ready(self) -> str:
        return self.name

    def generate(self, samples, start: int, stop: int, budget_bps: int, step: int, cuts: tuple[int, ...] = ()) -> tuple:
        """(a small summary, one RolloutShard per piece of [start, stop) between `cuts`).

        Called with num_returns = 1 + pieces, so the driver fetches only the summary and
        each piece goes to the learner rank whose prompts it holds.
        """
        begin = time.perf_counter()
        rollouts = self.engine.rollout(samples[start:stop], budget_bps, step)
        for r in rollouts:
            r.prompt_index += start
        seconds = time.perf_counter() - begin
        tokens = sum(r.response_ids.numel() for r in rollouts)
        self.metrics.record(tokens, seconds, budget_bps)
        summary = {"worker": self.name, "seconds": seconds, "tokens": tokens, "weights_version": self.weights_version}
        bounds = [start, *(c for c in cuts if start < c < stop), stop]
        pieces = []
        for lo, hi in zip(bounds, bounds[1:]):
            mine = [r for r in rollouts if lo <= r.prompt_index < hi]
            pieces.append(RolloutShard(lo, mine, self.name, self.weights_version, seconds, sum(r.response_ids.numel() for r in mine)))
        return (summary, *pieces)

    def evaluate(self, samples, budget_bps: int, selector: str) -> dict:
        """Answer accuracy of the current student weights (greedy, exact match) at `budget_bps`."""
        from ..evaluation import score_answers

        responses = self.engine.respond(
            samples, budget_bps, selector, self.job.eval.max_new_tokens, self.job.data.system_prompt, stop=("</answer>",)
        )
        result = score_answers(samples, responses, budget_bps, selector)
        return {"selector": selector, "budget_bps": budget_bps, "accuracy": result.accuracy, "weights_version": self.weights_version}

    def evaluate_benchmark(self, benchmarks: dict, name: str, budget_bps: int, selector: str) -> dict:
        """One benchmark's own score for the current student weights (greedy) at `budget_bps` with `selector`."""
        from ..evals.benchmarks import benchmark

        items = benchmarks[name]
        responses = self.engine.respond([i.sample for i in items], budget_bps, selector, self.job.eval.max_new_tokens, None, stop=())
        score = benchmark(name).score(items, responses)["score"]
        return {"benchmark": name, "selector": selector, "score": score, "weights_version": self.weights_version}

    def join_weight_sync(self, host: str, port: int, rank: int, world: int, generation: int, timeout_s: float) -> str:
        from .weight_sync import SyncGroup, join_store

        self.sync = SyncGroup(join_store(host, port, timeout_s), rank, world, generation, timeout_s, device=sync_device())
        return self.name

    def receive_weights(self, version: int) -> dict:
        """One weight update, written into the engine bucket by bucket as it arrives."""
        from .weight_sync import WeightUpdateRefused

        begin = time.perf_counter()
        previous, self.weights_version = self.weights_version, None  # torn until the update is complete
        try:
            self.weights_version = self.sync.receive(self.engine.sink(), version)
        except WeightUpdateRefused:
            self.weights_version = previous  # refused before anything was written
            raise
        return {"worker": self.name, "version": self.weights_version, "seconds": time.perf_counter() - begin}

    def weights_checksum(self, dtype: str) -> tuple[int | None, str]:
        from .weight_sync import WIRE_DTYPES

        return self.weights_version, self.engine.weights_checksum(WIRE_DTYPES[dtype])

    def pid(self) -> int:
        import os

        return os.getpid()


def sync_device() -> str:
    """The weight-sync transport's device: NCCL on this process's GPU, else gloo on CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class RolloutPool:
    """Creates, calls and replaces the rollout actors."""

    def __init__(self, job: JobConfig):
        self.job = job
        pool = job.pools.rollout
        self._actor_cls = ray.remote(num_cpus=pool.cpus, num_gpus=pool.gpus, resources=pool.ray_resources())(RolloutWorker)
        self.names = [f"rollout-{i}" for i in range(pool.workers)]
        self.workers = [self._spawn(name) for name in self.names]
        ray.get([w.ready.remote() for w in self.workers])

    def _spawn(self, name: str):
        return self._actor_cls.remote(self.job, name)

    def async_generate(
        self, samples_ref, count: int, budget_bps: int, step: int, learner_ranges: list[tuple[int, int]] | None = None
    ) -> tuple[list[ShardRef], list]:
        """The shards of every (worker, learner rank) pair that share prompts, and one summary ref per worker.

        `learner_ranges`: each learner rank's [start, stop) of the `count` prompts (default: one rank, all).
        """
        learner_ranges = learner_ranges or [(0, count)]
        shards, summaries = [], []
        for worker, (start, stop) in zip(self.workers, split_evenly(count, len(self.workers))):
            if stop == start:
                continue
            ranks = [rank for rank, (lo, hi) in enumerate(learner_ranges) if max(lo, start) < min(hi, stop)]
            cuts = tuple(learner_ranges[rank][0] for rank in ranks[1:])
            summary, *pieces = worker.generate.options(num_returns=1 + len(ranks)).remote(samples_ref, start, stop, budget_bps, step, cuts)
            summaries.append(summary)
            shards += [ShardRef(rank, piece) for rank, piece in zip(ranks, pieces)]
        return shards, summaries

    def evaluate(self, samples_ref, budget_bps: int, selectors: list[str]) -> list[dict]:
        """One evaluation per selector, spread over the workers (all hold the same weights)."""
        refs = [self.workers[i % len(self.workers)].evaluate.remote(samples_ref, budget_bps, name) for i, name in enumerate(selectors)]
        return ray.get(refs)

    def evaluate_benchmarks(self, benchmarks_ref, names: list[str], budget_bps: int, selectors: list[str]) -> list[dict]:
        """Every (benchmark, selector) score, spread over the workers."""
        pairs = [(name, selector) for name in names for selector in selectors]
        refs = [
            self.workers[i % len(self.workers)].evaluate_benchmark.remote(benchmarks_ref, name, budget_bps, selector)
            for i, (name, selector) in enumerate(pairs)
        ]
        return ray.get(refs)

    def dead_workers(self, timeout_s: float = 10.0) -> list[int]:
        refs = [w.ready.remote() for w in self.workers]
        dead = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(i)
        return dead

    def checksums(self, dtype: str = "float32") -> list[tuple[int | None, str]]:
        """(weights version, digest of the weights in `dtype`) of every worker."""
        return ray.get([w.weights_checksum.remote(dtype) for w in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)

    def replace(self, index: int) -> None:
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._spawn(self.names[index])
        ray.get(self.workers[index].ready.remote())
