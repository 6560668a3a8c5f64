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
    """Holds the student and answers generate / evaluate / weight-sync calls.

    The transformers model is always there: it receives the weight broadcast (and
    answers checksums and evaluations). With `pools.rollout.backend: vllm` a vLLM
    engine samples the rollouts and is reloaded in place from that model after every
    sync. In the fixed-prefix and SFT modes the worker also holds a frozen copy of the
    initial weights that samples the responses at full tokens (transformers only).
    """

    def __init__(self, job: JobConfig, name: str):
        import transformers

        from ..models.adapter import QwenVLM
        from ..models.loading import load_vlm
        from ..models.processor import VLMProcessor
        from ..reference import sampling_params
        from ..selectors import build_selector
        from .metrics import RolloutMetrics

        transformers.logging.set_verbosity_error()
        self.job, self.name = job, name
        model_dir, model = load_vlm(job.model.path)
        self.processor = VLMProcessor(model_dir, job.data.min_pixels, job.data.max_pixels)
        self.vlm = QwenVLM(model.eval().requires_grad_(False))
        # the fixed-prefix and SFT ablations sample with the frozen initial weights (the teacher)
        self.behaviour = None if job.objective.mode == "lt_opd" else QwenVLM(load_vlm(job.model.path)[1].eval().requires_grad_(False))
        self.selector = build_selector(job.selector.name)
        self.params = sampling_params(job, self.processor.tokenizer)
        self.engine = None
        if job.pools.rollout.backend == "vllm":
            from ..engines.vllm_engine import engine_for_job

            self.engine = engine_for_job(job, model_dir, role="rollout")
        self.weights_version = 0
        self.sync = None  # set by join_weight_sync
        self.metrics = RolloutMetrics(job.name, name)

    def ready(self) -> str:
        return self.name

    def generate(self, samples, start: int, stop: int, budget_bps: int, step: int, cuts: tuple[int, ...] = ()) -> tuple:
        """(a small summary, one RolloutShard per piece of [start, stop) between `cuts`).

        Called with num_returns = 1 + pieces, so the driver fetches only the summary and
        each piece goes to the learner rank whose prompts it holds.
        """
        from ..models.loading import compute_precision
        from ..models.processor import encode_samples
        from ..update import rollout

        begin = time.perf_counter()
        mine = samples[start:stop]
        prompts = encode_samples(self.processor, mine, self.job.data.system_prompt)
        uids = [s.uid for s in mine]
        if self.engine is not None:
            from ..engines.vllm_roles import vllm_rollout
            from ..models.processor import load_image

            rollouts = vllm_rollout(
                self.engine, prompts, [[load_image(s.image, s.uid)] for s in mine], uids, self.job.selector.name, budget_bps,
                self.job.budget.k_min, self.params, self.job.sampling.n, self.job.seed, step,
            )
        else:
            with compute_precision(self.job.model.dtype, self.vlm.device):
                rollouts = rollout(
                    self.vlm, self.processor.tokenizer, prompts, uids, self.selector, budget_bps,
                    self.job.budget.k_min, self.params, self.job.sampling.n, self.job.seed, step, self.behaviour,
                )
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
        from ..evaluation import evaluate_answers
        from ..models.loading import compute_precision

        with compute_precision(self.job.model.dtype, self.vlm.device):
            result = evaluate_answers(
                self.vlm, self.processor, samples, budget_bps, selector, self.job.budget.k_min,
                self.job.data.system_prompt, self.job.eval.max_new_tokens,
            )
        return {"selector": selector, "budget_bps": budget_bps, "accuracy": result.accuracy, "weights_version": self.weights_version}

    def evaluate_benchmark(self, benchmarks: dict, name: str, budget_bps: int, selector: str) -> dict:
        """One benchmark's own score for the current student weights (greedy) at `budget_bps` with `selector`."""
        from ..evals.benchmarks import benchmark
        from ..evaluation import generate_responses
        from ..models.loading import compute_precision

        items = benchmarks[name]
        with compute_precision(self.job.model.dtype, self.vlm.device):
            responses = generate_responses(
                self.vlm, self.processor, [i.sample for i in items], budget_bps, selector, self.job.budget.k_min,
                max_new_tokens=self.job.eval.max_new_tokens,
            )
        score = benchmark(name).score(items, responses)["score"]
        return {"benchmark": name, "selector": selector, "score": score, "weights_version": self.weights_version}

    def join_weight_sync(self, host: str, port: int, rank: int, world: int, generation: int, timeout_s: float) -> str:
        from .weight_sync import SyncGroup, join_store

        self.sync = SyncGroup(join_store(host, port, timeout_s), rank, world, generation, timeout_s)
        return self.name

    def receive_weights(self, version: int, bucket_bytes: int) -> dict:
        begin = time.perf_counter()
        self.weights_version = self.sync.receive(self.vlm.model, version, bucket_bytes)
        if self.engine is not None:
            self.engine.load_weights(list(self.vlm.model.state_dict().items()))
        return {"worker": self.name, "version": self.weights_version, "seconds": time.perf_counter() - begin}

    def weights_checksum(self) -> tuple[int, str]:
        from .weight_sync import weights_checksum

        return self.weights_version, weights_checksum(self.vlm.model.named_parameters())

    def pid(self) -> int:
        import os

        return os.getpid()


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

    def checksums(self) -> list[tuple[int, str]]:
        return ray.get([w.weights_checksum.remote() for w in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)

    def replace(self, index: int) -> None:
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._spawn(self.names[index])
        ray.get(self.workers[index].ready.remote())
