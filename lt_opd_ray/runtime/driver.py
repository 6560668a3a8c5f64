"""The driver: the LT-OPD update loop over the four Ray roles (docs/architecture.md §2, §4).

    submit(t)          budget r(t), the update's prompts -> rollout groups -> teacher (streamed, group by group)
    train(t)           the learners train on update t's groups as they arrive: one optimizer step
    [submit(t + 1)]    max_staleness 1: the next update is sampled by the current weights meanwhile
    sync(t + 1)        the new weights to every rollout worker, once they are idle
    checkpoint, eval

It passes ObjectRefs between the roles; rollouts and teacher payloads never
travel through this process (but for a checkpoint's in-flight rollouts). The roles
are what `roles` starts (runtime/roles.py: Ray's, or in tests in-process fakes);
the driver calls them only through their protocols and the object store.
"""

from __future__ import annotations

import functools
import time
import warnings

from ray.exceptions import RayActorError, RayError

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.batch_order import batches
from lt_opd_ray.core.curriculum import BPS, BudgetSchedule
from lt_opd_ray.core.wire import (
    LearnerStepResult,
    RolloutGroup,
    RolloutSummary,
    ScoringRequest,
    Span,
    Stopwatch,
    SyncResult,
)
from lt_opd_ray.runtime.checkpoint import CheckpointStore
from lt_opd_ray.runtime.dynamic_rounds import DynamicSampling
from lt_opd_ray.runtime.in_flight import InFlight
from lt_opd_ray.runtime.metrics import DriverMetrics
from lt_opd_ray.runtime.roles import RAY_ROLES, Roles
from lt_opd_ray.runtime.rollout_pool import REPLACE_ATTEMPTS, GroupRef
from lt_opd_ray.runtime.step_log import StepLog, summarize
from lt_opd_ray.runtime.waits import NoAnswerError, RoleDiedError, Watched

# The teacher's replica count in each update's busy fractions may be this old (Serve is asked at most this often).
REPLICA_COUNT_MAX_AGE_S = 10.0


class Driver(DynamicSampling):
    def __init__(self, job: JobConfig, resume: bool = False, roles: Roles = RAY_ROLES):
        self.job = job
        self.objects = roles.objects
        self.schedule = BudgetSchedule.from_config(job.budget)
        self.startup: dict[str, float] = {}  # seconds per start-up phase, in order
        self.pools_ready: dict[str, float] = {}  # seconds from the pools' common start until each was ready
        clock = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal clock
            self.startup[phase], clock = time.perf_counter() - clock, time.perf_counter()

        self.samples, benchmarks, eval_samples = roles.preflight(job)  # every problem at once, before any actor starts
        self.rows_by_uid = {s.uid: s for s in self.samples}
        self.checkpoints = CheckpointStore(job)
        tag, passed_over = self.checkpoints.choose() if resume else (None, [])  # verified before any actor starts
        lap("checks")
        self.rollouts = self.teacher = self.learners = self.judge = None
        self.lost_workers: set[int] = set()  # rollout workers stopped inside the update, replaced after it
        self.stepping = False  # the learners are inside a step (run_step: from its start until their results are in)
        try:  # what the run starts, it removes, also when a later pool fails to start
            begin = time.time()  # the three pools start together: each loads its model while the others do
            if job.objective.teacher_scores:  # the cross-entropy modes' loss reads no teacher: no teacher pool
                self.teacher = roles.teacher(job)  # first: Serve's controller creates its replicas after the deploy
            if job.reward.uses_judge:  # a reward that needs a model: its own Serve pool
                self.judge = roles.reward_pool(job)
            self.rollouts = roles.rollout_pool(job)
            self.learners = roles.learner_group(job)
            if self.teacher is not None:
                self.pools_ready["teacher (Serve)"] = self.teacher.wait_ready() - begin
            if self.judge is not None:
                self.pools_ready["reward judge (Serve)"] = self.judge.wait_ready() - begin
            self.pools_ready["rollout workers"] = self.rollouts.wait_ready() - begin  # as each pool's actors say
            self.pools_ready["learners (DeepSpeed)"] = self.learners.wait_ready() - begin
            self.placements = [*self.rollouts.placements(), *(self.teacher.placements() if self.teacher else []),
                               *(self.judge.placements() if self.judge else []), *self.learners.placements()]
            lap("pools")
            self.sync = roles.broadcaster(self.learners, self.rollouts, job.pools.learner.sync_timeout_s)
            self.metrics = DriverMetrics(job.name)
            self.step, self.cursor, kept = 0, 0, []
            self.restored = self.checkpoints.restore(self.learners, tag, passed_over) if tag else None
            dynamic = {}
            if self.restored is not None:
                self.step, self.cursor, kept = self.restored.state["step"], self.restored.state["cursor"], self.restored.in_flight
                dynamic = self.restored.state.get("dynamic_sampling", {})
                lap("checkpoint load")
            self.checkpoints.record_run(resumed_from=tag)
            self.broadcast(version=self.step)  # workers start from exactly the learners' weights
            lap("first weight sync")
            self.data = batches(self.samples, job.sampling.prompts_per_step, job.data.shuffle_seed, self.cursor)
            self.next: InFlight | None = self.resubmit(kept, dynamic) if kept else None  # submitted ahead (max_staleness 1)
        except BaseException:
            self.shutdown()
            raise
        self.eval_ref = self.objects.put(eval_samples) if eval_samples else None
        self.benchmarks_ref = self.objects.put(benchmarks) if benchmarks else None
        self.last_end = time.time()

    # ------------------------------------------------------------------ the schedule
    def run_step(self) -> StepLog:
        update = self.step
        current, self.next = self.next or self.submit(update), None
        training = self.learners.async_train_step(current.batch, current.groups, self.rollouts.names, update, self.scoring(current.samples_ref))
        self.stepping = True
        if self.job.schedule.max_staleness and update + 1 < self.job.budget.total_steps:
            self.next = self.submit(update + 1)  # sampled by weights v(update) while the learners train on update
        ranks = self.learners.wait(training, f"learner step of update {update}", upstream=self.samplers(current))
        self.stepping = False
        for rank, result in enumerate(ranks):
            for _ in range(result.teacher_retries):
                self.metrics.record_restart("teacher")
            if result.teacher_retries:
                print(f"teacher: {result.teacher_retries} scoring request(s) of learner-{rank} in update {update} sent again: the replica"
                      " serving them died (Serve replaced it)", flush=True)
        self.step += 1
        self.cursor += len(current.batch)
        summaries = self.rollouts.wait([g.summary for g in current.groups], self.group_workers(current), f"rollout summaries of update {update}")
        lost = self.settle(self.next) if self.next else []
        self.replace_workers({**{i: f"stopped inside update {update}" for i in self.lost_workers},
                              **{self.next.groups[i].worker: f"died sampling update {update + 1}" for i in lost}})
        with Stopwatch() as sync_watch:
            sync = self.broadcast(version=self.step)  # before any rollout of the next weights
        if lost:
            self.resubmit_lost(self.next, lost)  # sampled by the new weights: staleness 0
        spans = [sync_watch.span("sync", "learner-0", f"v{self.step}")]
        if self.step % self.job.checkpoint.every_steps == 0 or self.step == self.job.budget.total_steps:
            with Stopwatch() as watch:
                self.checkpoint()
            spans.append(watch.span("checkpoint", "driver", f"step-{self.step}"))
        accuracy, by_kind, scores = {}, {}, {}
        if self._evaluates_now():
            with Stopwatch() as watch:
                accuracy, by_kind, scores = self.evaluate()
            spans.append(watch.span("eval", "rollout", f"v{self.step}"))
        return self.log(current, ranks, summaries, sync.bytes, spans, accuracy, scores, by_kind)

    def checkpoint(self) -> str:
        """A checkpoint of the current step (with the next update's rollouts when they are in flight), unless the
        latest already is one; returns where it is."""
        tag = f"step-{self.step}"
        if self.checkpoints.latest() != tag:
            state = {"step": self.step, "cursor": self.cursor, "steps_per_update": self.job.optimizer.steps_per_update}
            if self.next is not None and self.job.reward.dynamic_sampling_rounds:  # the in-flight update's new rows and counts
                state["dynamic_sampling"] = {"drawn": {str(slot): uid for slot, uid in self.next.drawn.items()},
                                             "resampled": self.next.resampled, "flat": self.next.flat}
            self.checkpoints.save(self.learners, state, self.fetch_groups(self.next))
        return self.checkpoints.storage.describe(tag)

    def submit(self, update: int) -> InFlight:
        """Queue update `update`'s rollout groups on the workers and their scoring with their learner ranks, all at
        once; returns at once, however many requests the teacher can admit (the ranks send them as it does)."""
        batch = next(self.data)
        budget = self.schedule.budget_bps(update)  # c = optimizer steps completed before this update
        samples_ref = self.objects.put(batch)
        ranges = self.learners.prompt_ranges(len(batch))
        flight = InFlight(update, budget, batch, samples_ref, self.rollouts.submit(samples_ref, budget, update, ranges, self.job.schedule.group_prompts))
        if self.job.reward.dynamic_sampling_rounds:
            self.resample_flat_groups(flight)
        self.request_scores(flight.samples_ref, flight.groups)
        return flight

    def live_workers(self) -> list[int]:
        """The rollout workers not stopped inside the update."""
        return [w for w in range(len(self.rollouts.names)) if w not in self.lost_workers]

    def scoring(self, samples_ref) -> ScoringRequest | None:
        """How the learner ranks ask the teacher about the update's samples; None where the job has no teacher."""
        return ScoringRequest(self.teacher.app_name, samples_ref, self.teacher.run) if self.teacher is not None else None

    def request_scores(self, samples_ref, groups: list[GroupRef]) -> None:
        """Each group's learner rank asks the teacher to score it (returns at once); nothing where the objective reads
        no teacher scores."""
        if self.teacher is not None:
            self.learners.request_scores(self.scoring(samples_ref), groups)

    def settle(self, pending: InFlight) -> list[int]:
        """Wait (bounded) until the next update's groups are sampled, so the workers are free for the weights.
        Returns the groups whose worker died before finishing them (their workers are then replaced)."""
        names = self.group_workers(pending)
        _, late = self.objects.wait([g.summary for g in pending.groups], num_returns=len(pending.groups), timeout=self.job.schedule.wait_timeout_s)
        if late:
            late_names = sorted({names[i] for i, g in enumerate(pending.groups) if g.summary in late})
            raise NoAnswerError(f"rollout groups of update {pending.update}: no answer after {self.job.schedule.wait_timeout_s:.0f} s from {', '.join(late_names)}")
        lost = []
        for i, group in enumerate(pending.groups):
            try:
                self.objects.get(group.summary)  # ready (waited for above): returns or raises at once
            except RayActorError:
                lost.append(i)
        return lost

    def replace_workers(self, lost: dict[int, str]) -> None:
        """New workers in place of those `lost` (index -> what happened to it) and any other that died meanwhile;
        they join the sync group, and the broadcast that follows gives them the weights. One line each."""
        indices = {index: "died" for index in self.rollouts.dead_workers()} | lost
        for index in sorted(indices):
            self.rollouts.replace(index)
            self.metrics.record_restart("rollout")
            print(f"{self.rollouts.names[index]} replaced by a new worker ({indices[index]}); the next broadcast gives it the weights", flush=True)
        if indices:
            self.sync.connect()
        self.lost_workers.clear()

    def resubmit_lost(self, pending: InFlight, lost: list[int]) -> None:
        for i in lost:
            old = pending.groups[i]
            group = self.rollouts.submit_group(pending.samples_ref, old.start, old.stop, old.learner_rank, pending.budget_bps, old.update, old.worker)
            pending.groups[i] = group
            self.request_scores(pending.samples_ref, [group])

    def fetch_groups(self, pending: InFlight | None) -> list[RolloutGroup]:
        """The finished groups of the update in flight, to be kept with a checkpoint."""
        if pending is None:
            return []
        return self.rollouts.wait([g.group for g in pending.groups], self.group_workers(pending), "rollout groups for a checkpoint")

    def resubmit(self, kept: list[RolloutGroup], dynamic: dict) -> InFlight | None:
        """The in-flight update a checkpoint kept: its groups go back into the object store and to the teacher;
        `dynamic`: what dynamic sampling did to it (the slots given new rows, by uid, and its counts)."""
        if self.job.schedule.max_staleness == 0:
            return None  # sampled one version behind: an on-policy job samples that update afresh
        batch = next(self.data)
        drawn = {int(slot): uid for slot, uid in dynamic.get("drawn", {}).items()}
        for slot, uid in drawn.items():
            if uid not in self.rows_by_uid:
                raise ValueError(f"checkpoint {self.restored.tag}: the in-flight update {kept[0].update} trains on row {uid} (drawn by dynamic"
                                 " sampling), which data.path no longer holds: resume with the rows the run was started with")
            batch[slot] = self.rows_by_uid[uid]
        samples_ref = self.objects.put(batch)
        groups = [
            GroupRef(g.update, g.start, g.stop, g.learner_rank, 0, self.objects.put(g), self.objects.put(g.summary()))
            for g in kept
        ]
        self.request_scores(samples_ref, groups)
        return InFlight(kept[0].update, kept[0].rollouts[0].budget_bps, batch, samples_ref, groups, drawn=drawn,
                        resampled=dynamic.get("resampled", 0), flat=dynamic.get("flat", 0))

    def samplers(self, flight: InFlight) -> list[Watched]:
        """Every rollout worker, watched while any of `flight`'s groups on it is still being sampled; one that dies or
        stops answering is done without (`sample_elsewhere`). Pinged by index: a worker replaced inside the update is
        watched in its place."""

        finished: set = set()  # summaries known sampled: each group is asked about until it is, not on every tick

        def doing(worker: int):
            def now() -> str | None:
                finished.update(g.summary for g in flight.groups if g.worker == worker and g.summary not in finished and self.sampled(g))
                unfinished = [g for g in flight.groups if g.worker == worker and g.summary not in finished]
                return (f"sampling prompts {', '.join(f'{g.start}-{g.stop - 1}' for g in unfinished)} of update {flight.update}"
                        if unfinished else None)
            return now

        return [Watched(name, functools.partial(self.rollouts.ping, i), doing(i), functools.partial(self.sample_elsewhere, flight, i))
                for i, name in enumerate(self.rollouts.names)]

    def sampled(self, group: GroupRef) -> bool:
        """The group's rollouts are in the object store (not: still sampling, or its worker died on it)."""
        return self.outcome(group) == "sampled"

    def died(self, group: GroupRef) -> bool:
        """The group's worker died before it was sampled (its summary answers with the actor's death)."""
        return self.outcome(group) == "died"

    def outcome(self, group: GroupRef) -> str:
        """Where the group stands, asked without waiting: "sampling", "sampled", "died" (its worker) or "failed"."""
        if not self.objects.wait([group.summary], timeout=0)[0]:
            return "sampling"
        try:
            self.objects.get(group.summary)
            return "sampled"
        except RayActorError:
            return "died"
        except RayError:
            return "failed"

    def sample_elsewhere(self, flight: InFlight, lost: int, why: str) -> bool:
        """Worker `lost` died or stopped answering inside the update: it is stopped and its unfinished groups are
        sampled again (the same rollouts: sampling is seeded by update, sample and response, not by worker) and
        scored, each going to its learner rank in place of the lost one. By the live workers, the lost one replaced
        after the update; where none lives, by replacements started now (`replace_inside`). False where neither can be.
        `why`: what happened to it (died, or silent for how long, while doing what), for the line this prints."""
        survivors = [i for i in range(len(self.rollouts.names)) if i != lost and i not in self.lost_workers]
        if not survivors:
            return self.replace_inside(flight, lost, why)
        self.rollouts.stop(lost)
        self.lost_workers.add(lost)
        again = self.sample_again(flight, {lost}, survivors)
        print(f"{self.rollouts.names[lost]} lost inside update {flight.update} ({why}): prompts {', '.join(again) or '(none left)'} sampled"
              f" again by {', '.join(self.rollouts.names[i] for i in survivors)}; it is replaced after the update", flush=True)
        return True

    def replace_inside(self, flight: InFlight, lost: int, why: str) -> bool:
        """No worker lives: every lost one is replaced now, given the learners' weights while their step waits (learner
        rank 0 sends them from a second thread: it holds whole weights only under ZeRO 0-2, so False under ZeRO-3)
        and samples the unfinished groups. A worker replaced more than REPLACE_ATTEMPTS times inside one update (a
        prompt that kills its worker) ends the run in one line."""
        if self.job.pools.learner.zero_stage == 3:
            return False
        gone = sorted(self.lost_workers | {lost})
        for index in gone:
            flight.replaced[index] += 1
            if flight.replaced[index] > REPLACE_ATTEMPTS:
                unfinished = [f"{g.start}-{g.stop - 1}" for g in flight.groups if g.worker == index and not self.sampled(g)]
                raise RoleDiedError(f"{self.rollouts.names[index]} was lost {flight.replaced[index]} times inside update {flight.update}, each"
                                    f" replacement in turn, while sampling prompts {', '.join(unfinished)}: one of them may stop its worker")
            self.rollouts.replace(index)  # stops the lost one first
            self.metrics.record_restart("rollout")
        self.lost_workers.clear()
        self.sync.connect()
        self.sync.broadcast_inside_step(version=self.step)  # the weights the update's rollouts are sampled by
        again = self.sample_again(flight, set(gone), gone)
        print(f"{', '.join(self.rollouts.names[i] for i in gone)} lost inside update {flight.update} with no other worker"
              f" ({self.rollouts.names[lost]} {why}): replaced, given weights v{self.step} by learner-0 while the learners wait, and"
              f" prompts {', '.join(again) or '(none left)'} sampled again", flush=True)
        return True

    def sample_again(self, flight: InFlight, lost: set[int], by: list[int]) -> list[str]:
        """The unfinished groups of the `lost` workers, submitted again round-robin over `by` and scored; each goes
        to its learner rank as a substitute. Returns their prompt ranges."""
        again = []
        for i, old in enumerate(flight.groups):
            if old.worker not in lost or self.sampled(old):
                continue
            group = self.rollouts.submit_group(flight.samples_ref, old.start, old.stop, old.learner_rank, flight.budget_bps, old.update,
                                               by[len(again) % len(by)])
            flight.groups[i] = group
            self.request_scores(flight.samples_ref, [group])
            self.learners.substitute(old.learner_rank, old.update, old.start, [self.rollouts.names[group.worker], group.group])
            again.append(f"{old.start}-{old.stop - 1}")
        return again

    def group_workers(self, flight: InFlight) -> list[str]:
        return [self.rollouts.names[g.worker] for g in flight.groups]

    # ------------------------------------------------------------------ reporting
    def log(
        self, current: InFlight, ranks: list[LearnerStepResult], summaries: list[RolloutSummary], sync_bytes: int,
        spans: list[Span], accuracy: dict, scores: dict, by_kind: dict,
    ) -> StepLog:
        end = time.time()
        period, self.last_end = end - self.last_end, end
        sizes = {"rollout": len(self.rollouts.names), "teacher": self.teacher.replicas(max_age_s=REPLICA_COUNT_MAX_AGE_S) if self.teacher else 0, "learner": self.learners.ranks}
        log = summarize(current.update, current.budget_bps, ranks, [s.span for s in summaries], spans, sizes, period, sync_bytes, accuracy, scores,
                        rewards=[value for s in summaries for value in s.rewards], by_kind=by_kind)
        if self.job.reward.dynamic_sampling_rounds:
            log.resampled_groups, log.flat_groups = current.resampled, current.flat
        reward = (log.reward_mean, log.reward_std, log.resampled_groups or 0, log.flat_groups or 0) if log.reward_mean is not None else None
        self.metrics.record(self.step, current.budget_bps, log.phases, samples=log.sequences, pool_sizes=sizes, staleness=log.staleness,
                            reward=reward)
        return log

    def _evaluates_now(self) -> bool:
        return self.job.eval.enabled and (self.step % self.job.eval.every_steps == 0 or self.step == self.job.budget.total_steps)

    def evaluate(self) -> tuple[dict[str, float], dict[str, dict[str, float]], dict[str, float]]:
        """The current student (just synced to the rollout workers): accuracy per selector, per selector and kind of
        question (where the rows carry kinds), benchmark scores."""
        budget = self.job.eval_budget_bps
        accuracy, by_kind, scores = {}, {}, {}
        if self.eval_ref is not None:
            results = self.rollouts.evaluate(self.eval_ref, budget, self.job.eval.selectors)
            accuracy = {r.selector: r.accuracy for r in results}
            by_kind = {r.selector: r.by_kind for r in results if r.by_kind}
            self.metrics.record_eval(budget, accuracy)
        if self.benchmarks_ref is not None:
            results = self.rollouts.evaluate_benchmarks(self.benchmarks_ref, list(self.job.eval.benchmarks), budget, self.job.eval.selectors)
            scores = {f"{r.benchmark}[{r.selector}]": r.score for r in results}
            self.metrics.record_benchmarks(budget, results)
        return accuracy, by_kind, scores

    def evaluate_baseline(self) -> tuple[float, dict[str, float]]:
        """The student before any update: its accuracy on `eval.data` at full visual tokens (any selector keeps
        every token there) and per selector at the eval budget."""
        budget = self.job.eval_budget_bps
        full = self.rollouts.evaluate(self.eval_ref, BPS, self.job.eval.selectors[:1])[0].accuracy
        at_budget = {r.selector: r.accuracy for r in self.rollouts.evaluate(self.eval_ref, budget, self.job.eval.selectors)}
        self.metrics.record_eval(budget, at_budget)
        return full, at_budget

    def export_student(self) -> str:
        """The current student as a Hugging Face folder, the run's `final/` (written atomically by learner rank 0;
        to a URI, uploaded by rank 0 with config.json last, which marks it finished); returns where it is."""
        storage = self.checkpoints.storage
        self.learners.save_pretrained(str(storage.local / "final"))
        if storage.remote:
            self.learners.upload(storage.location, self.job.checkpoint.staging_dir, "final", "final", ("config.json",))
        return storage.describe("final")

    def replace_dead_rollout_workers(self) -> list[str]:
        """Between updates: replace workers that died, re-form the sync group and give them the current weights.
        (Groups a worker finished before it died stay in the object store; unfinished ones are resubmitted by `settle`.)"""
        dead = self.rollouts.dead_workers()
        if not dead:
            return []
        for index in dead:
            self.rollouts.replace(index)
            self.metrics.record_restart("rollout")
        self.sync.connect()
        self.broadcast(version=self.step)
        return [self.rollouts.names[i] for i in dead]

    def broadcast(self, version: int) -> SyncResult:
        """The weight broadcast; a worker replaced because it died during it counts as a rollout restart."""
        before = len(self.sync.replaced)
        result = self.sync.broadcast(version)
        for name in self.sync.replaced[before:]:
            self.metrics.record_restart("rollout")
            print(f"{name} died during the weight broadcast v{version}: replaced, and the weights sent again", flush=True)
        return result

    def shutdown(self) -> None:
        """Stop every pool, also when one of them failed or died: what the run started, it removes."""
        problems = []
        for name, pool in (("teacher", self.teacher), ("reward judge", self.judge), ("learners", self.learners), ("rollout workers", self.rollouts)):
            if pool is None:
                continue  # never started
            try:
                pool.shutdown()
            except Exception as exc:  # noqa: BLE001 - the other pools must still be stopped
                problems.append(f"{name}: {exc!r}"[:300])
        if problems:
            warnings.warn("stopping the pools: " + "; ".join(problems), stacklevel=2)
