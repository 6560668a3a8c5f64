"""In-process roles for the driver (lt_opd_ray/runtime/roles.py): its schedule in seconds, without Ray.

They keep the contracts the driver relies on, not the models: each fake actor answers its calls in order on a
thread of its own (a Ray actor's default concurrency group) and its pings at once (its control thread); refs are
futures (`LocalObjects`) that raise Ray's errors, so a call on an actor that died, or one under way when it died,
raises `ActorDiedError`. A vLLM-like pool samples its groups concurrently and refuses a weight write while any is
being sampled (`WeightUpdateRefused`), as `engines/vllm/engine.py` does.

The "weights" are a digest of everything the learners trained on: each update hashes the previous digest with the
update's (sample, tokens, budget) records, and a response's tokens hash the digest that sampled it with (update,
sample, response, budget), so one lost, repeated or differently sampled rollout anywhere changes every later digest. `reference_digests` is the same arithmetic as a plain loop over the schedule's contract
(update t is sampled by the weights after update t - 1 - staleness), which the driver's runs are checked against.
The learner ranks run the real `GroupReceiver` (prompt order, substitutes, the staleness bound) and `unpack_scores`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path

import torch
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from lt_opd_ray.core.batch_order import batches
from lt_opd_ray.core.curriculum import BudgetSchedule
from lt_opd_ray.core.microbatch import split_evenly
from lt_opd_ray.core.wire import (
    BenchmarkResult,
    EvalResult,
    LearnerStepResult,
    Rollout,
    RolloutGroup,
    Stopwatch,
    SyncResult,
    TeacherRun,
    TeacherScore,
    pack_scores,
)
from lt_opd_ray.runtime.group_receiver import GroupReceiver, ScoreRequests, Substitutes
from lt_opd_ray.runtime.job_inputs import read_job_inputs
from lt_opd_ray.runtime.learner_group import rank_requests, rank_work
from lt_opd_ray.runtime.preflight import PreflightError
from lt_opd_ray.runtime.rollout_pool import REPLACE_ATTEMPTS, GroupRef, deal, group_bounds
from lt_opd_ray.runtime.waits import NoAnswerError, RoleDiedError, Watched, wait_for, wait_watched
from lt_opd_ray.weight_sync.ends import WeightSyncError, WeightUpdateRefused

INITIAL = "initial weights"
VOCAB = 1000  # the fake student's vocabulary: every token and teacher id below it


# ---------------------------------------------------------------------------------------------- the fake "model"
def response_tokens(digest: str, update: int, uid: str, response: int, budget_bps: int) -> tuple[int, ...]:
    """The response the weights `digest` sample (1-3 tokens), seeded by update, sample and response as the real
    engines are: the same whichever worker samples it."""
    h = hashlib.sha256(f"{digest}|{update}|{uid}|{response}|{budget_bps}".encode()).digest()
    return tuple(b % VOCAB for b in h[1 : 2 + h[0] % 3])


def advance(digest: str, records: list[tuple]) -> str:
    """The weights after training on `records` (sorted: the order groups arrive in does not matter)."""
    return hashlib.sha256(f"{digest}|{sorted(records)!r}".encode()).hexdigest()


def reference_digests(job, samples: list, steps: int) -> tuple[list[str], list[list[tuple]]]:
    """(weights after each update, each update's records) as the schedule defines them: update t trains on the t-th
    batch, sampled at budget r(t) by the weights v(max(0, t - max_staleness)), n responses per prompt."""
    schedule, staleness = BudgetSchedule.from_config(job.budget), job.schedule.max_staleness
    data = batches(samples, job.sampling.prompts_per_step, job.data.shuffle_seed, 0)
    digests, trained = [INITIAL], []
    for update in range(steps):
        batch, version, budget = next(data), max(0, update - staleness), schedule.budget_bps(update)
        records = [(s.uid, response_tokens(digests[version], update, s.uid, j, budget), budget) for s in batch for j in range(job.sampling.n)]
        trained.append(sorted(records))
        digests.append(advance(digests[-1], records))
    return digests, trained


# ---------------------------------------------------------------------------------------------- refs and actors
class LocalObjects:
    """The object store (runtime/objects.ObjectStore) over futures."""

    def put(self, value) -> Future:
        ref = Future()
        ref.set_result(value)
        return ref

    def wait(self, refs: list, *, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while sum(r.done() for r in refs) < num_returns:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            wait_futures([r for r in refs if not r.done()], timeout=left, return_when=FIRST_COMPLETED)
        ready = [r for r in refs if r.done()][:num_returns]
        return ready, [r for r in refs if not any(r is s for s in ready)]

    def get(self, refs, *, timeout: float | None = None):
        if isinstance(refs, list):
            return [self.get(ref, timeout=timeout) for ref in refs]
        try:
            return refs.result(timeout)
        except TimeoutError:
            raise GetTimeoutError(f"no value within {timeout} s") from None


def settle(ref: Future, value=None, error: BaseException | None = None) -> None:
    """Resolve `ref` unless its actor's death resolved it first."""
    try:
        ref.set_exception(error) if error is not None else ref.set_result(value)
    except InvalidStateError:
        pass


class FakeActor:
    """Calls answered in order on one thread; pings at once unless frozen; `kill` fails every call not answered."""

    def __init__(self, name: str, threads: int = 1):
        self.name, self.dead, self.frozen = name, False, False
        self.calls = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self.pending: set[Future] = set()
        self.killed = threading.Event()

    def call(self, method, *args, returns: int = 1, on: ThreadPoolExecutor | None = None) -> list[Future]:
        """`method(*args)` on the actor's ordered thread (or on `on`); `returns` refs, one per value it returns."""
        refs = [Future() for _ in range(returns)]
        if self.dead:
            for ref in refs:
                settle(ref, error=ActorDiedError())
            return refs
        self.pending.update(refs)

        def run():
            try:
                values = method(*args)
                for ref, value in zip(refs, values if returns > 1 else [values]):
                    settle(ref, value)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, as Ray does
                for ref in refs:
                    settle(ref, error=ActorDiedError() if self.dead else exc)
            self.pending.difference_update(refs)

        (on or self.calls).submit(run)
        return refs

    def ping(self) -> Future:
        ref = Future()
        if self.dead:
            settle(ref, error=ActorDiedError())
        elif self.frozen:
            self.pending.add(ref)  # answered by nobody; failed when the actor is killed
        else:
            settle(ref, time.time())
        return ref

    def freeze(self) -> None:
        """Stop answering anything, pings included, and block the call under way until killed."""
        self.frozen = True
        self.killed.wait(timeout=120)
        raise ActorDiedError()

    def kill(self) -> None:
        self.dead = True
        self.killed.set()
        for ref in list(self.pending):
            settle(ref, error=ActorDiedError())
        self.calls.shutdown(wait=False, cancel_futures=True)


@dataclass
class Fault:
    """Rollout worker `worker` dies (or freezes) when it starts sampling update `update` (`at` "generate") or
    receiving weights `update` (`at` "receive"); once, unless `every_time`."""

    worker: int
    update: int
    how: str = "die"
    at: str = "generate"
    every_time: bool = False


# ---------------------------------------------------------------------------------------------- the roles
class FakeWorker(FakeActor):
    def __init__(self, name: str, index: int, roles: FakeRoles):
        super().__init__(name)
        self.index, self.roles = index, roles
        self.version, self.digest = 0, INITIAL  # a worker starts from the model folder: the initial weights
        self.sampling = 0  # groups being sampled now (a vLLM-like worker samples several at once)
        self.sampler = ThreadPoolExecutor(8, thread_name_prefix=f"{name}-sampling") if roles.concurrent else None

    def hit(self, at: str, update: int) -> None:
        for fault in self.roles.faults:
            if (fault.worker, fault.update, fault.at) == (self.index, update, at):
                if not fault.every_time:
                    self.roles.faults.remove(fault)
                if fault.how == "freeze":
                    self.freeze()
                self.kill()
                raise ActorDiedError()

    def generate(self, samples_ref, groups: list[tuple[int, int, int]], budget_bps: int, update: int) -> tuple:
        self.hit("generate", update)
        self.sampling += 1
        try:
            version, digest = self.version, self.digest
            samples = self.roles.objects.get(samples_ref)
            with Stopwatch() as watch:
                self.roles.sampling_allowed.wait()
                time.sleep(self.roles.sample_seconds)
            out = []
            for start, stop, rank in groups:
                rollouts = [self.rollout(i, j, samples[i].uid, digest, update, budget_bps) for i in range(start, stop)
                            for j in range(self.roles.job.sampling.n)]
                group = RolloutGroup(update, start, stop, rank, rollouts, self.name, version, watch.span("rollout", self.name, f"u{update}"))
                out += [group.summary(), group]
            return tuple(out)
        finally:
            self.sampling -= 1

    def rollout(self, prompt: int, response: int, uid: str, digest: str, update: int, budget_bps: int) -> Rollout:
        tokens = torch.tensor(response_tokens(digest, update, uid, response, budget_bps))
        k = self.roles.job.objective.top_k
        return Rollout(prompt, tokens, torch.zeros(len(tokens)), torch.zeros(len(tokens), k, dtype=torch.long), [], budget_bps, "stop")

    def kill(self) -> None:
        super().kill()
        if self.sampler is not None:
            self.sampler.shutdown(wait=False, cancel_futures=True)

    def receive_weights(self, version: int, learners: FakeLearnerGroup) -> SyncResult:
        self.hit("receive", version)
        if self.sampling:
            raise WeightUpdateRefused(f"{self.name}: a weight update while {self.sampling} group(s) are being sampled")
        if learners.version != version:
            raise WeightSyncError(f"{self.name} expected weights v{version}, the learners hold v{learners.version}")
        self.version, self.digest = learners.version, learners.digest
        return SyncResult(version, 64, "float32", 0.0)


class FakeRolloutPool:
    def __init__(self, roles: FakeRoles, job):
        self.roles, self.job = roles, job
        self.names = [f"rollout-{i}" for i in range(job.pools.rollout.workers)]
        self.workers = [FakeWorker(name, i, roles) for i, name in enumerate(self.names)]
        self.replaced: list[int] = []  # indices, in order

    def wait_ready(self) -> float:
        return time.time()

    def placements(self) -> list:
        return []

    def submit(self, samples_ref, budget_bps: int, update: int, learner_ranges, group_prompts: int) -> list[GroupRef]:
        bounds = group_bounds(learner_ranges, group_prompts)
        calls = deal(bounds, len(self.workers), call_per_group=self.roles.concurrent)
        refs = {g: ref for worker, groups in calls for g, ref in zip(groups, self._generate(samples_ref, groups, budget_bps, update, worker))}
        return [refs[g] for g in bounds]

    def submit_group(self, samples_ref, start: int, stop: int, rank: int, budget_bps: int, update: int, worker: int) -> GroupRef:
        return self._generate(samples_ref, [(start, stop, rank)], budget_bps, update, worker)[0]

    def _generate(self, samples_ref, groups, budget_bps: int, update: int, index: int) -> list[GroupRef]:
        worker = self.workers[index]  # a vLLM-like worker samples its groups at once, beside its ordered calls
        refs = worker.call(worker.generate, samples_ref, groups, budget_bps, update, returns=2 * len(groups), on=worker.sampler)
        return [GroupRef(update, start, stop, rank, index, refs[2 * i + 1], refs[2 * i]) for i, (start, stop, rank) in enumerate(groups)]

    def wait(self, refs: list, names: list[str], what: str) -> list:
        return wait_for(refs, names, self.job.schedule.wait_timeout_s, what, objects=self.roles.objects)

    def ping(self, index: int) -> Future:
        return self.workers[index].ping()

    def stop(self, index: int) -> None:
        self.workers[index].kill()

    def replace(self, index: int) -> None:
        for _ in range(REPLACE_ATTEMPTS):
            self.workers[index].kill()
            self.workers[index] = FakeWorker(self.names[index], index, self.roles)
            self.replaced.append(index)
            try:
                self.workers[index].hit("start", 0)
                return
            except ActorDiedError:
                continue
        raise RoleDiedError(f"{self.names[index]}: {REPLACE_ATTEMPTS} replacements in a row died while starting")

    def dead_workers(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w.dead or w.frozen]

    def evaluate(self, samples_ref, budget_bps: int, selectors: list[str]) -> list[EvalResult]:
        """Accuracy: the share of the digest's first byte, so it moves as the weights do."""
        return [EvalResult(s, budget_bps, int(self.workers[0].digest[:2], 16) / 255, self.workers[0].version) for s in selectors]

    def evaluate_benchmarks(self, benchmarks_ref, names: list[str], budget_bps: int, selectors: list[str]) -> list[BenchmarkResult]:
        return [BenchmarkResult(n, s, 0.5, self.workers[0].version) for n in names for s in selectors]

    def shutdown(self) -> None:
        self.roles.stopped.append("rollout workers")
        for worker in self.workers:
            worker.kill()


class FakeTeacher:
    """One replica with `roles.teacher_slots` request slots (Serve's max_ongoing_requests): `request` returns once a
    slot is free, and the request holds it until its group is sampled and scored, as a Serve request does."""

    app_name = "fake-teacher"
    run = TeacherRun(0, job_ref=None)

    def __init__(self, roles: FakeRoles, job):
        self.roles, self.job = roles, job
        self.replica = FakeActor("teacher", threads=roles.teacher_slots)  # requests answered concurrently, each as its group is sampled
        self.slots = threading.Semaphore(roles.teacher_slots)
        self.admitted = 0

    def request(self, scoring, group_ref, update: int, start: int, stop: int) -> Future:
        self.slots.acquire()  # admission
        self.admitted += 1
        (ref,) = self.replica.call(self.score, group_ref)
        ref.add_done_callback(lambda _: self.slots.release())
        return ref

    def score(self, group_ref) -> object:
        group = self.roles.objects.get(group_ref, timeout=self.job.schedule.wait_timeout_s)
        k, k_student = self.job.objective.top_k, self.job.objective.top_k
        scores = [TeacherScore(torch.arange(k, dtype=torch.int32).repeat(len(r.response_ids), 1), torch.full((len(r.response_ids), k), -2.0),
                               torch.full((len(r.response_ids), k_student + 1), -2.0)) for r in group.rollouts]
        payload = pack_scores(scores, "float32")
        payload.replica = self.replica.name
        return payload

    def replicas(self, max_age_s: float = 0.0) -> int:
        return 1

    def wait_ready(self) -> float:
        return time.time()

    def placements(self) -> list:
        return []

    def shutdown(self) -> None:
        self.roles.stopped.append("teacher")
        self.replica.kill()


class FakeLearnerGroup:
    """Ranks that each run the real GroupReceiver over their own groups; the update lands when every rank is done."""

    def __init__(self, roles: FakeRoles, job):
        self.roles, self.job = roles, job
        self.actors = [FakeActor(f"learner-{r}") for r in range(job.pools.learner.ranks)]
        self.substitutes = [Substitutes() for _ in self.actors]
        self.score_requests = [ScoreRequests(lambda *request: roles.teacher_role.request(*request)) for _ in self.actors]  # a job without a teacher asks none
        self.version, self.digest = 0, INITIAL
        self.history = {0: INITIAL}  # version -> digest, as the weights moved in this process (and as loaded)
        self.trained: dict[int, list[tuple]] = {}  # update -> its records, sorted
        self.step_records: list[tuple] = []

    @property
    def ranks(self) -> int:
        return len(self.actors)

    def wait_ready(self) -> float:
        if self.roles.learners_fail_to_start:
            raise NoAnswerError("learner setup: no answer after 1800 s from learner-1")
        return time.time()

    def placements(self) -> list:
        return []

    def prompt_ranges(self, prompts: int) -> list[tuple[int, int]]:
        return split_evenly(prompts, len(self.actors))

    def request_scores(self, scoring, groups: list[GroupRef]) -> None:
        for requests, mine in zip(self.score_requests, rank_requests(groups, len(self.actors))):
            for group_ref, update, start, stop in mine:
                requests.ask(scoring, group_ref, update, start, stop)

    def async_train_step(self, batch, groups, worker_names, version, scoring) -> list[Future]:
        work = rank_work(groups, worker_names, len(self.actors))
        self.step_records = []
        barrier = threading.Barrier(len(self.actors), action=lambda: self.land(version), timeout=self.job.schedule.wait_timeout_s)
        return [actor.call(self.train_rank, rank, batch, work[rank], version, scoring, barrier)[0] for rank, actor in enumerate(self.actors)]

    def train_rank(self, rank: int, batch, work: list, version: int, scoring, barrier: threading.Barrier) -> LearnerStepResult:
        receiver = GroupReceiver(work, version, self.job, rank, VOCAB, scoring, self.substitutes[rank], self.score_requests[rank], self.roles.objects)
        records, tokens, groups = [], 0, 0
        for streamed in receiver:
            streamed.wait_scores()  # the real unpack_scores checks the payload against the rollouts
            records += [(batch[r.prompt_index].uid, tuple(r.response_ids.tolist()), r.budget_bps) for r in streamed.rollouts]
            tokens, groups = tokens + sum(len(r.response_ids) for r in streamed.rollouts), groups + 1
        self.step_records.extend(records)
        barrier.wait()
        return LearnerStepResult(0.0, 0.0, 1.0, 1.0, tokens, len(records), len({r[0] for r in records}), groups, 0, 0, 0.0,
                                 staleness=receiver.staleness, payload_bytes=receiver.payload_bytes,
                                 payload_tokens=receiver.payload_tokens, teacher_retries=receiver.retries, spans=tuple(receiver.spans))

    def land(self, version: int) -> None:
        """Every rank has trained update `version`: the weights move to v(version + 1)."""
        assert self.version == version, f"a step for v{version} on weights v{self.version}"
        self.trained[version] = sorted(self.step_records)
        self.version, self.digest = version + 1, advance(self.digest, self.step_records)
        self.history[self.version] = self.digest

    def wait(self, refs: list, what: str, upstream: list[Watched] | None = None) -> list:
        names = [a.name for a in self.actors]
        ranks = [Watched(a.name, a.ping, lambda: what) for a in self.actors]
        watched = [*upstream, *ranks] if upstream is not None else []
        try:
            return wait_watched(refs, names, self.job.schedule.wait_timeout_s, what, watched, self.job.schedule.liveness_timeout_s,
                                self.roles.objects)
        except RayActorError as exc:
            raise RoleDiedError(f"a learner rank died while {what}") from exc

    def substitute(self, rank: int, update: int, start: int, refs: list) -> None:
        self.substitutes[rank].put((update, start), tuple(refs))

    def save_state(self, directory: str, tag: str) -> None:
        folder = Path(directory) / tag
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "fake_learner.json").write_text(json.dumps({"version": self.version, "digest": self.digest}))

    def load_state(self, directory: str, tag: str) -> None:
        state = json.loads((Path(directory) / tag / "fake_learner.json").read_text())
        self.version, self.digest = state["version"], state["digest"]
        self.history[self.version] = self.digest

    def save_pretrained(self, directory: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "digest").write_text(self.digest)

    def shutdown(self) -> None:
        self.roles.stopped.append("learners")
        for actor in self.actors:
            actor.kill()


class FakeBroadcaster:
    """The weights (the learners' version and digest) to every worker, after the worker's earlier calls; a worker
    that died during it is replaced and the broadcast runs again, once (as sync_coordinator.WeightBroadcaster)."""

    def __init__(self, roles: FakeRoles, learners: FakeLearnerGroup, rollouts: FakeRolloutPool, timeout_s: float):
        self.roles, self.learners, self.rollouts, self.timeout_s = roles, learners, rollouts, timeout_s
        self.replaced: list[str] = []
        self.generation = 0
        self.connect()

    def connect(self) -> None:
        self.generation += 1
        refs = [w.call(lambda: w.name)[0] for w in self.rollouts.workers]
        wait_for(refs, self.rollouts.names, self.timeout_s, "joining the weight-sync group", WeightSyncError, self.roles.objects)

    def broadcast(self, version: int) -> SyncResult:
        try:
            return self.broadcast_inside_step(version)
        except (RayActorError, WeightSyncError):
            dead = self.rollouts.dead_workers()
            if not dead:
                raise
        for index in dead:
            self.rollouts.replace(index)
            self.replaced.append(self.rollouts.names[index])
        self.connect()
        return self.broadcast_inside_step(version)

    def broadcast_inside_step(self, version: int) -> SyncResult:
        refs = [w.call(w.receive_weights, version, self.learners)[0] for w in self.rollouts.workers]
        results = wait_for(refs, self.rollouts.names, self.timeout_s, f"weight broadcast v{version}", WeightSyncError, self.roles.objects)
        return results[0]


class FakeRewardPool:
    """The reward judge's pool (runtime/reward_pool.RewardService) as the driver sees it: started, waited for,
    stopped; `roles.judge_fails_to_start` makes its replicas never answer."""

    app_name = "fake-reward"

    def __init__(self, roles: FakeRoles, job):
        self.roles = roles

    def wait_ready(self) -> float:
        if self.roles.judge_fails_to_start:
            raise NoAnswerError("reward judge: no answer after 1800 s from the Serve app fake-reward")
        return time.time()

    def placements(self) -> list:
        return []

    def shutdown(self) -> None:
        self.roles.stopped.append("reward judge")


class FakeRoles:
    """Where a driver under test gets its roles (runtime/roles.Roles); `faults` are consumed as they strike."""

    def __init__(self, faults: list[Fault] = (), concurrent: bool = False, sample_seconds: float = 0.0, learners_fail_to_start: bool = False,
                 teacher_slots: int = 8, judge_fails_to_start: bool = False):
        self.objects = LocalObjects()
        self.faults = list(faults)
        self.concurrent, self.sample_seconds, self.learners_fail_to_start = concurrent, sample_seconds, learners_fail_to_start
        self.judge_fails_to_start = judge_fails_to_start
        self.teacher_slots = teacher_slots
        self.sampling_allowed = threading.Event()  # cleared: every worker holds its groups until it is set
        self.sampling_allowed.set()
        self.teacher_role: FakeTeacher | None = None  # made before the learners, who send it their groups
        self.stopped: list[str] = []  # pools shut down, in order
        self.job = None

    def preflight(self, job):
        self.job = job
        inputs, problems = read_job_inputs(job)
        if problems:
            raise PreflightError("\n".join(problems))
        return inputs.samples, inputs.benchmarks, inputs.eval_samples

    def rollout_pool(self, job) -> FakeRolloutPool:
        return FakeRolloutPool(self, job)

    def learner_group(self, job) -> FakeLearnerGroup:
        return FakeLearnerGroup(self, job)

    def teacher(self, job) -> FakeTeacher:
        self.teacher_role = FakeTeacher(self, job)
        return self.teacher_role

    def reward_pool(self, job) -> FakeRewardPool:
        return FakeRewardPool(self, job)

    def broadcaster(self, learners, rollouts, timeout_s: float) -> FakeBroadcaster:
        return FakeBroadcaster(self, learners, rollouts, timeout_s)


