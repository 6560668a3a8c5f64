"""The frozen full-token teacher behind a Ray Serve deployment, with request batching.

A request is one rollout group (plus the update's samples and the group's prompt
range), sent as soon as the group is submitted: the replica first runs the work on
the group's prompts that needs no rollouts (`TeacherEngine.prefill`: the full-token
prompt prefix), while they are sampled, then awaits the group itself, so groups are
scored as they are finished, and `@serve.batch` joins the groups that are ready together
into one engine call. The answer is a compact `wire.TeacherPayload`: int32 ids and
fp16/fp32 log-probs, one row per response position. Payloads are validated where
they enter the learner (`wire.unpack_scores`), so a malformed one fails with a
message naming the problem.
"""

from __future__ import annotations

from ray import serve

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.wire import ActorPlacement, RolloutGroup, ScoringRequest, Span, Stopwatch, TeacherPayload, TeacherRun, pack_scores
from lt_opd_ray.runtime.resources import free_run_memory, placement_here
from lt_opd_ray.runtime.rollout_pool import GroupRef
from lt_opd_ray.runtime.serve_apps import delete_app, deploy, deployment_options, replica_placements, wait_running


class TeacherModel:
    """The frozen full-token teacher of one replica: scores rollout groups with its engine (`engines.teacher_engines`)."""

    def __init__(self, job: JobConfig, name: str = "teacher"):
        import transformers

        from lt_opd_ray.engines.teacher_engines import build_teacher_engine
        from lt_opd_ray.runtime.metrics import TeacherMetrics

        transformers.logging.set_verbosity_error()
        self.job, self.name = job, name
        self.engine = build_teacher_engine(job)
        self.metrics = TeacherMetrics(job.name, name)
        self.prefill_spans: dict[tuple[int, int], Span] = {}  # (update, group start) -> its head start

    def prefill(self, samples, update: int, start: int, stop: int) -> None:
        """The head start on one group's prompts, before its rollouts exist (`TeacherEngine.prefill`)."""
        from lt_opd_ray.engines.teacher_engines import UPDATES_IN_FLIGHT

        with Stopwatch() as watch:
            ran = self.engine.prefill(update, {i: samples[i] for i in range(start, stop)})
        self.prefill_spans = {key: span for key, span in self.prefill_spans.items() if key[0] > update - UPDATES_IN_FLIGHT}
        if ran:
            self.prefill_spans[(update, start)] = watch.span("teacher", self.name, f"u{update} p{start}-{stop - 1} prefix")

    def score_groups(self, samples, groups: list[RolloutGroup]) -> list[TeacherPayload]:
        """Scores every rollout of every group (all of one update) in one engine call (each prompt's full-token
        prefix once, or taken from `prefill`); one payload per group."""
        (update,) = {group.update for group in groups}
        with Stopwatch() as watch:
            rollouts = [r for group in groups for r in group.rollouts]
            scores = self.engine.score({r.prompt_index: samples[r.prompt_index] for r in rollouts}, rollouts, update)
        payloads, offset = [], 0
        for group in groups:
            payload = pack_scores(scores[offset : offset + len(group.rollouts)], self.job.pools.teacher.payload_dtype)
            head_start = self.prefill_spans.pop((update, group.start), None)
            scoring = watch.span("teacher", self.name, f"u{update} p{group.start}-{group.stop - 1}")
            payload.spans, payload.replica = (*([head_start] if head_start else []), scoring), self.name
            payloads.append(payload)
            offset += len(group.rollouts)
        tokens = sum(r.response_ids.numel() for r in rollouts)
        self.metrics.record(tokens, watch.end - watch.start, sum(p.nbytes for p in payloads))
        return payloads


class EndedRunRequest(RuntimeError):
    """A scoring request of a run the replica has moved on from (a kept app serves the next run): nobody awaits it."""


@serve.deployment
class TeacherDeployment:
    def __init__(self, job: JobConfig):
        import asyncio
        import os

        self.name = f"teacher-{os.getpid()}"
        self.model, self.run = TeacherModel(job, name=self.name), 0  # the run (`TeacherRun.ordinal`) it scores for
        self.failed: Exception | None = None  # why the run's teacher could not be built (then self.model is None)
        self.score_batch.set_max_batch_size(job.pools.teacher.max_batch_size)
        self.switching = asyncio.Lock()
        self.held = 0  # scoring requests admitted and not yet answered (each holds one of max_ongoing_requests)

    async def model_for(self, run: TeacherRun) -> TeacherModel:
        """This run's teacher: built from its job on a later run's first call (the earlier run's freed first), a
        refusal for an earlier run's. Call it after every await: a later run may have begun meanwhile."""
        if run.ordinal > self.run:
            async with self.switching:
                if run.ordinal > self.run:
                    job = await run.job_ref
                    self.model, self.failed, self.run = None, None, run.ordinal
                    free_run_memory()
                    try:
                        self.model = TeacherModel(job, name=self.name)
                    except Exception as exc:  # every call of this run is refused with it, not built again
                        self.failed = exc
                    self.score_batch.set_max_batch_size(job.pools.teacher.max_batch_size)
        if run.ordinal < self.run:
            raise EndedRunRequest(f"{self.name}: a scoring request of run {run.ordinal}; the replica serves run {self.run}")
        if self.model is None:
            raise RuntimeError(f"{self.name}: the teacher of run {run.ordinal} could not be built: {self.failed!r}") from self.failed
        return self.model

    # The groups finished within a few ms of the first join its batch: a worker's groups of one static batch come back
    # together, but each request resumes from its own await, so with no wait the first would be scored alone. Groups
    # finishing later queue while this batch is scored.
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def score_batch(self, requests: list[tuple]) -> list[TeacherPayload | None]:
        # each request: (samples ref, finished RolloutGroup, run ordinal). Groups of the same update (same samples)
        # share one engine call; other updates' get their own. An ended run's request gets None (`score` refuses it).
        by_update: dict = {}
        for index, (samples_ref, _, _) in enumerate(requests):
            by_update.setdefault(samples_ref, []).append(index)
        payloads: list = [None] * len(requests)
        for samples_ref, indices in by_update.items():
            if requests[indices[0]][2] != self.run:  # one update's samples are one run's
                continue
            samples = await samples_ref
            current = [i for i in indices if requests[i][2] == self.run]  # the run may have ended during the await
            for i, payload in zip(current, self.model.score_groups(samples, [requests[i][1] for i in current])):
                payloads[i] = payload
        return payloads

    async def pid(self) -> int:
        import os

        return os.getpid()

    async def placement(self, run: TeacherRun) -> tuple[str, ActorPlacement]:
        """(this replica's Serve id, its placement running `run`'s teacher: a kept replica builds it here, as the run
        starts)."""
        engine = (await self.model_for(run)).engine
        return serve.get_replica_context().replica_id.unique_id, placement_here(self.name, engine.runner, engine.missing_kernels)

    async def score(self, request: tuple) -> TeacherPayload:
        # request: `score_request`. The head start runs before the group is awaited, while it is sampled; awaiting
        # the group here, before the batch forms, lets a batch take the groups that are finished, not the first submitted.
        (samples_ref,), (group_ref,), (update, start, stop), run = request
        self.held += 1
        try:
            samples = await samples_ref
            (await self.model_for(run)).prefill(samples, update, start, stop)
            group = await group_ref
            await self.model_for(run)
            payload = await self.score_batch((samples_ref, group, run.ordinal))
            if payload is None:
                await self.model_for(run)  # the run ended while its request waited for the batch: refused
            return payload
        finally:
            self.held -= 1

    async def holding(self) -> int:
        """Scoring requests this replica holds now (admitted, not yet answered)."""
        return self.held


def score_request(samples_ref, group_ref, update: int, start: int, stop: int, run: TeacherRun) -> tuple:
    """What `TeacherDeployment.score` takes for one group: the refs nested in lists, so Serve hands them over
    unresolved, the group's update and prompt range, so the replica can start on its prompts before it is sampled,
    and its run (whose job ref stays unresolved until a replica needs it)."""
    return ([samples_ref], [group_ref], (update, start, stop), run)


def ask(handle, samples_ref, group_ref, update: int, start: int, stop: int, run: TeacherRun):
    """ObjectRef[TeacherPayload] of one group's request through `handle`; returns once Serve has admitted it (a
    replica had a free slot: `max_ongoing_requests`), which may be long after it is asked: call it off any loop that
    must go on."""
    return handle.score.remote(score_request(samples_ref, group_ref, update, start, stop, run))._to_object_ref_sync()


class TeacherClient:
    """A learner rank's requests to its run's teacher: `ask` through one handle (one Serve router) per app, made on
    its first request. One per run: a rank kept for a later run (runtime/kept_roles.py) gets a new one, never an
    earlier run's handle to an app of the same name."""

    def __init__(self):
        self.handles: dict[str, object] = {}

    def __call__(self, scoring: ScoringRequest, group_ref, update: int, start: int, stop: int):
        if scoring.app not in self.handles:
            self.handles[scoring.app] = serve.get_app_handle(scoring.app)
        return ask(self.handles[scoring.app], scoring.samples_ref, group_ref, update, start, stop, scoring.run)


class TeacherService:
    """Client side: starts the deployment and turns score requests into ObjectRefs."""

    def __init__(self, job: JobConfig):
        import ray

        self.app_name = f"{job.name}-teacher"
        self.handle = deploy(TeacherDeployment.options(**deployment_options(job.pools.teacher, job)).bind(job), self.app_name, job.name)
        self.run, self.build_timeout_s = TeacherRun(0, ray.put(job)), job.schedule.wait_timeout_s
        self._replicas: tuple[float, int] | None = None  # (when counted, running replicas)

    def start_run(self, job: JobConfig) -> TeacherService:
        """This app, serving `job`'s run next (runtime/kept_roles.py): each replica builds its teacher on the run's
        first call (`placements`, as the run starts) and refuses the earlier runs' requests from then on."""
        import ray

        self.run, self.build_timeout_s = TeacherRun(self.run.ordinal + 1, ray.put(job)), job.schedule.wait_timeout_s
        self._replicas = None
        return self

    def wait_ready(self) -> float:
        return wait_running(self.app_name)

    def async_score(self, samples_ref, groups: list[GroupRef]) -> list:
        """ObjectRef[TeacherPayload] per group, each returned once Serve admits it (`ask`): a replica starts
        on each group's prompts at once and scores the group when it is finished. The bulk data stays in the object
        store. (The run's learner ranks ask from a thread of their own: `group_receiver.ScoreRequests`.)"""
        return [ask(self.handle, samples_ref, g.group, g.update, g.start, g.stop, self.run) for g in groups]

    def replicas(self, max_age_s: float = 0.0) -> int:
        """Running replicas of the teacher deployment (moves with autoscaling), as counted at most `max_age_s` ago:
        asking Serve takes ~30 ms of the driver's time, too much to spend on every update's metrics."""
        import time

        if self._replicas is None or time.monotonic() - self._replicas[0] > max_age_s:
            status = serve.status().applications[self.app_name].deployments["TeacherDeployment"]
            self._replicas = (time.monotonic(), int(status.replica_states.get("RUNNING", 0)))
        return self._replicas[1]

    def placements(self) -> list[ActorPlacement]:
        # a kept replica builds the run's teacher as it answers (a model load: bounded by schedule.wait_timeout_s)
        return replica_placements(self.handle, self.replicas(), self.run, timeout_s=self.build_timeout_s)

    def shutdown(self) -> None:
        delete_app(self.app_name)
