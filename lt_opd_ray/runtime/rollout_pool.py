"""The rollout pool: N Ray actors, each owning one engine that holds the current student.

`submit` cuts an update's prompts into groups of `schedule.group_prompts` prompts,
never across two learner ranks' prompt ranges, and deals them over the workers
in the order the learners consume them (each rank's first group, then each
rank's second, ...). A vLLM worker gets every group as its own call, all feeding its
one engine, so each is handed over (to the teacher, then to its one learner rank) as
soon as its sequences finish. A transformers worker, which batches statically (a
batch runs until its longest response), gets all its groups in one call and samples
them as one batch, each group still its own ObjectRef. Sampling and selection are
seeded by (seed, update, sample uid, response index), so the rollouts depend on
neither the worker, the grouping nor the rank count.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import ray

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.wire import (
    ActorPlacement,
    BenchmarkResult,
    EvalResult,
    RolloutGroup,
    Stopwatch,
    WeightsReceived,
)
from lt_opd_ray.runtime.resources import first_torch_seed, free_run_memory, placement_here, restart_torch_generators
from lt_opd_ray.runtime.waits import RoleDiedError, wait_for

# A second thread per actor for the calls that must be answered while a long call runs (liveness, sync aborts);
# every other call runs one at a time, in order, in the default group, but the rollout groups of a vLLM worker:
# they run on threads of their own ("sampling"), all feeding one engine (engines/vllm/loop.py).
CONTROL = {"control": 1}
REPLACE_ATTEMPTS = 3  # replacements of one worker started in a row before the run gives up on it


def concurrency_groups(job: JobConfig) -> dict[str, int]:
    pool = job.pools.rollout
    return CONTROL | ({"sampling": pool.engine_groups} if pool.backend == "vllm" else {})


@dataclass(frozen=True)
class GroupRef:
    """Where one RolloutGroup will live, which learner rank trains on it, and its small summary."""

    update: int
    start: int
    stop: int
    learner_rank: int
    worker: int  # index into the pool's workers
    group: ray.ObjectRef  # ObjectRef[RolloutGroup]
    summary: ray.ObjectRef  # ObjectRef[RolloutSummary]: what the driver reads, without the bulk data


def group_bounds(ranges: list[tuple[int, int]], group_prompts: int) -> list[tuple[int, int, int]]:
    """(start, stop, learner rank) of every group, in the order the learners consume them."""
    per_rank = [[(lo, min(lo + group_prompts, stop), rank) for lo in range(start, stop, group_prompts)] for rank, (start, stop) in enumerate(ranges)]
    return [group for position in range(max(map(len, per_rank))) for groups in per_rank if position < len(groups) for group in [groups[position]]]


def deal(bounds: list[tuple[int, int, int]], workers: int, call_per_group: bool) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """The generate calls of an update: (worker, its groups) with the groups dealt round-robin in `bounds`' order; a
    call per group (vLLM: they share the engine's batch) or a call per worker (transformers: one static batch)."""
    dealt: dict[int, list[tuple[int, int, int]]] = {}
    for i, group in enumerate(bounds):
        dealt.setdefault(i % workers, []).append(group)
    return [(worker, [group]) for worker, groups in dealt.items() for group in groups] if call_per_group else list(dealt.items())


class RolloutWorker:
    """Owns one rollout engine (`engines.rollout_engines`: transformers or vLLM) holding the current student,
    and answers generate / evaluate / weight-sync calls."""

    def __init__(self, job: JobConfig, name: str):
        self.first_seed = first_torch_seed()
        self.start_run(job, name)

    def end_run(self) -> bool:
        """A run's end on a worker kept for another (`runtime/kept_roles.py`), after every call the run queued: its
        engine, reward and weight-sync group let go and what they held freed. True: nothing of the run runs on."""
        self.engine = self.reward = self.sync = None
        free_run_memory()
        return True

    def start_run(self, job: JobConfig, name: str) -> float:
        """Everything of one run: its engine (the job's model), reward and metrics, torch's generators where a new
        process starts them; a kept worker starts its next run here, in the process it has. Returns when it was
        ready."""
        import transformers

        from lt_opd_ray.engines.rollout_engines import build_rollout_engine
        from lt_opd_ray.evals.rewards import JobReward
        from lt_opd_ray.runtime.metrics import RolloutMetrics

        transformers.logging.set_verbosity_error()
        restart_torch_generators(self.first_seed)
        self.job, self.name = job, name
        self.engine = build_rollout_engine(job)
        judge = None
        if job.reward.uses_judge:  # Ray Serve's import (~1 CPU-second a process) only where the judge's app is asked
            from lt_opd_ray.runtime.reward_pool import JudgeClient, reward_app

            judge = JudgeClient(reward_app(job), job.schedule.liveness_timeout_s)
        self.reward = JobReward.of(job, judge)  # the judge's pool is asked as the worker gives rewards
        self.rewarding = threading.Lock()
        self.weights_version: int | None = 0  # None while an update is half written
        self.sync = None  # set by join_weight_sync
        self.metrics = RolloutMetrics(job.name, name)
        self.loaded_at = time.time()
        return self.loaded_at

    @ray.method(concurrency_group="control")
    def ready(self) -> float:
        """When its engine was ready (wall clock); answered while a long call runs (it is also the liveness ping)."""
        return self.loaded_at

    @ray.method(concurrency_group="control")
    def abort_weight_sync(self) -> None:
        """Free a `receive_weights` blocked on a sync group whose sender or another member is gone."""
        if self.sync is not None:
            self.sync.abort()

    def generate(self, samples, groups: list[tuple[int, int, int]], budget_bps: int, update: int) -> tuple:
        """The rollouts of each group (start, stop, learner rank) of `update`, sampled as one batch: (summary, group)
        per group, flattened (called with num_returns=2 x groups: the driver reads the summaries, the teacher and
        the learner ranks the groups). A vLLM worker runs several calls at once in one engine."""
        version = self.weights_version  # the engine refuses a weight write while any group is sampled
        prompts = [i for start, stop, _ in groups for i in range(start, stop)]
        with Stopwatch() as watch:
            rollouts = self.engine.rollout([samples[i] for i in prompts], budget_bps, update)
        for r in rollouts:
            r.prompt_index = prompts[r.prompt_index]  # the update's prompt index
        if self.reward is not None:
            self.give_rewards(samples, rollouts)
        out = []
        for start, stop, learner_rank in groups:
            span = watch.span("rollout", self.name, f"u{update} p{start}-{stop - 1}")
            group = RolloutGroup(update, start, stop, learner_rank, [r for r in rollouts if start <= r.prompt_index < stop], self.name, version, span)
            out += [group.summary(), group]
        self.metrics.record(sum(r.response_ids.numel() for r in rollouts), watch.end - watch.start, budget_bps)
        return tuple(out)

    def give_rewards(self, samples, rollouts) -> None:
        """Each rollout's reward against its own row (a RewardError names the reward and the row). A vLLM worker
        samples several calls at once on threads; their rewards are given one call at a time (a user's reward need
        not be thread-safe), but the judge's, whose client is, as they come (its pool batches them)."""
        rows = [samples[r.prompt_index] for r in rollouts]
        texts = self.engine.response_texts(rollouts)
        with contextlib.nullcontext() if self.job.reward.uses_judge else self.rewarding:  # the judge's client is thread-safe
            values = self.reward(rows, texts, [r.response_ids.numel() for r in rollouts])
        for r, value in zip(rollouts, values):
            r.reward = value

    def evaluate(self, samples, budget_bps: int, selector: str) -> EvalResult:
        """Answer accuracy of the current student weights (greedy, exact match) at `budget_bps`."""
        from lt_opd_ray.models.evaluation import score_answers

        responses = self.engine.respond(
            samples, budget_bps, selector, self.job.eval.max_new_tokens, self.job.data.system_prompt, stop=("</answer>",)
        )
        result = score_answers(samples, responses, budget_bps, selector)
        return EvalResult(selector, budget_bps, result.accuracy, self.weights_version, result.by_kind(samples))

    def evaluate_benchmark(self, benchmarks: dict, name: str, budget_bps: int, selector: str) -> BenchmarkResult:
        """One benchmark's own score for the current student weights (greedy) at `budget_bps` with `selector`."""
        from lt_opd_ray.evals.benchmarks import benchmark

        items = benchmarks[name]
        responses = self.engine.respond([i.sample for i in items], budget_bps, selector, self.job.eval.max_new_tokens, None, stop=())
        score = benchmark(name).score(items, responses)["score"]
        return BenchmarkResult(name, selector, score, self.weights_version)

    def join_weight_sync(self, host: str, port: int, rank: int, world: int, generation: int, timeout_s: float) -> str:
        from lt_opd_ray.weight_sync.group import SyncGroup, join_store

        self.sync = SyncGroup(join_store(host, port, timeout_s), rank, world, generation, timeout_s, device=sync_device())
        return self.name

    def receive_weights(self, version: int) -> WeightsReceived:
        """One weight update, written into the engine bucket by bucket as it arrives."""
        from lt_opd_ray.weight_sync.ends import WeightUpdateRefused

        begin = time.perf_counter()
        previous, self.weights_version = self.weights_version, None  # torn until the update is complete
        try:
            self.weights_version = self.sync.receive(self.engine.sink(), version)
        except WeightUpdateRefused:
            self.weights_version = previous  # refused before anything was written
            raise
        return WeightsReceived(self.name, self.weights_version, time.perf_counter() - begin)

    def weights_checksum(self, dtype: str) -> tuple[int | None, str]:
        from lt_opd_ray.weight_sync.layout import WIRE_DTYPES

        return self.weights_version, self.engine.weights_checksum(WIRE_DTYPES[dtype])

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        import os

        return os.getpid()

    def placement(self) -> ActorPlacement:
        return placement_here(self.name, self.engine.runner, self.engine.missing_kernels)


def sync_device() -> str:
    """The weight-sync transport's device: NCCL on this process's current GPU (with its index, as a tensor's
    device reads), else gloo on the host."""
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


class RolloutPool:
    """Creates, calls and replaces the rollout actors."""

    def __init__(self, job: JobConfig, kept: list | None = None):
        """`kept`: the workers of an earlier run whose pool had this one's shape (`runtime/kept_roles.py`); each starts
        this run in its own process instead of a new one starting."""
        self.job = job
        pool = job.pools.rollout
        self._actor_cls = ray.remote(
            num_cpus=pool.cpus, num_gpus=pool.gpus, resources=pool.ray_resources(), concurrency_groups=concurrency_groups(job)
        )(RolloutWorker)
        self._sampling = {"concurrency_group": "sampling"} if pool.backend == "vllm" else {}
        self.names = [f"rollout-{i}" for i in range(pool.workers)]
        self.replaced = 0  # workers stopped or replaced in this run
        if kept is None:
            self.workers = [self._spawn(name) for name in self.names]  # they load their models while the other pools start
            self.starting = [w.ready.remote() for w in self.workers]
        else:
            self.workers = kept
            self.starting = [w.start_run.remote(job, name) for w, name in zip(kept, self.names)]

    def wait_ready(self) -> float:
        """Wall clock when the last worker was ready."""
        return max(self.wait(self.starting, self.names, "starting the rollout workers"))

    def _spawn(self, name: str):
        return self._actor_cls.remote(self.job, name)

    def submit(self, samples_ref, budget_bps: int, update: int, learner_ranges: list[tuple[int, int]], group_prompts: int) -> list[GroupRef]:
        """Queue every group of an update over the workers; `learner_ranges`: each rank's [start, stop) of its prompts."""
        return self.submit_groups(samples_ref, group_bounds(learner_ranges, group_prompts), budget_bps, update, list(range(len(self.workers))))

    def submit_groups(self, samples_ref, bounds: list[tuple[int, int, int]], budget_bps: int, update: int, workers: list[int]) -> list[GroupRef]:
        """Queue these groups (start, stop, learner rank) of `update`, dealt over `workers` (indices) as `deal` does."""
        calls = deal(bounds, len(workers), call_per_group=bool(self._sampling))
        refs = {group: ref for n, groups in calls for group, ref in zip(groups, self._generate(samples_ref, groups, budget_bps, update, workers[n]))}
        return [refs[group] for group in bounds]

    def submit_group(self, samples_ref, start: int, stop: int, rank: int, budget_bps: int, update: int, worker: int) -> GroupRef:
        return self._generate(samples_ref, [(start, stop, rank)], budget_bps, update, worker)[0]

    def _generate(self, samples_ref, groups: list[tuple[int, int, int]], budget_bps: int, update: int, worker: int) -> list[GroupRef]:
        refs = self.workers[worker].generate.options(num_returns=2 * len(groups), **self._sampling).remote(samples_ref, groups, budget_bps, update)
        return [GroupRef(update, start, stop, rank, worker, refs[2 * i + 1], refs[2 * i]) for i, (start, stop, rank) in enumerate(groups)]

    def evaluate(self, samples_ref, budget_bps: int, selectors: list[str]) -> list[EvalResult]:
        """One evaluation per selector, spread over the workers (all hold the same weights)."""
        refs = [self.workers[i % len(self.workers)].evaluate.remote(samples_ref, budget_bps, name) for i, name in enumerate(selectors)]
        return self.wait(refs, [self.names[i % len(self.workers)] for i in range(len(refs))], "evaluation")

    def evaluate_benchmarks(self, benchmarks_ref, names: list[str], budget_bps: int, selectors: list[str]) -> list[BenchmarkResult]:
        """Every (benchmark, selector) score, spread over the workers."""
        pairs = [(name, selector) for name in names for selector in selectors]
        refs = [
            self.workers[i % len(self.workers)].evaluate_benchmark.remote(benchmarks_ref, name, budget_bps, selector)
            for i, (name, selector) in enumerate(pairs)
        ]
        return self.wait(refs, [self.names[i % len(self.workers)] for i in range(len(refs))], "benchmark evaluation")

    def wait(self, refs: list, names: list[str], what: str) -> list:
        return wait_for(refs, names, self.job.schedule.wait_timeout_s, what)

    def dead_workers(self, timeout_s: float = 10.0) -> list[int]:
        refs = [w.ready.remote() for w in self.workers]
        dead = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(i)
        return dead

    def placements(self) -> list[ActorPlacement]:
        return self.wait([w.placement.remote() for w in self.workers], self.names, "the rollout workers' placement")

    def checksums(self, dtype: str = "float32") -> list[tuple[int | None, str]]:
        """(weights version, digest of the weights in `dtype`) of every worker."""
        return self.wait([w.weights_checksum.remote(dtype) for w in self.workers], self.names, "weight checksums")

    def ping(self, index: int) -> ray.ObjectRef:
        """Worker `index`'s liveness ping (`RolloutWorker.ready`, answered while a long call runs)."""
        return self.workers[index].ready.remote()

    def stop(self, index: int) -> None:
        """Stop worker `index` for good (a stuck one too: it must not answer late); `replace` starts its successor."""
        self.replaced += 1
        ray.kill(self.workers[index], no_restart=True)

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)

    def replace(self, index: int) -> None:
        """A new worker in place of `index` (dead or stuck), started at most REPLACE_ATTEMPTS times when a
        replacement dies in turn; then one RoleDiedError naming it."""
        self.replaced += 1
        for attempt in range(1, REPLACE_ATTEMPTS + 1):
            ray.kill(self.workers[index], no_restart=True)
            self.workers[index] = self._spawn(self.names[index])
            try:
                self.wait([self.workers[index].ready.remote()], [self.names[index]], "starting a replacement rollout worker")
                return
            except ray.exceptions.RayActorError as exc:
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        raise RoleDiedError(f"{self.names[index]}: {REPLACE_ATTEMPTS} replacements in a row died while starting (last: {reason})")
