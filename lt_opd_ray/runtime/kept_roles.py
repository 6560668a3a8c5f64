"""Roles whose processes outlive a run: the next run of the same pool shape starts in them.

Most of a pool's start is its processes' own: each imports torch, transformers (and a learner rank DeepSpeed), ~5
CPU-seconds, before it loads a model (docs/benchmarks.md, driver start). A series of runs on one cluster (a study's
runs, the test suite's) pays that once per pool shape with `KeptRoles`: when a run stops, its rollout workers and
learner ranks end the run in their processes (`end_run`: engines destroyed, weight-sync groups and teacher requests
let go) and are kept if it left them sound; a later run whose pool has the same shape (the actors' resources, the
ranks, the rollout backend) takes them over and builds its engine, model, optimizer, reward and metrics in them
(`start_run`), torch's generators where a new process starts them. The teacher's Serve app is kept the same way
when its deployment's options are the next run's: that run's requests carry its job (`wire.TeacherRun`), from which
each replica builds the run's teacher on the run's first call (the start asks each replica its placement), refusing
the earlier run's requests from then on.
tests/test_runtime.py holds a run on kept pools to the same run on new ones, bit for bit.

A pool is kept only where its run left it sound: the driver was not stopped by an exception (its own or its
caller's), no worker was stopped or replaced, no call to the learner ranks failed or was given up on, every actor
ended the run within END_RUN_TIMEOUT_S (after the calls the run queued), and the teacher app is RUNNING. Otherwise it
is stopped as `RayRoles` stops it. What a process keeps beyond that: the modules a run imported (a user's reward
module), and the last value of each metric series its run exported (tagged with that run's name). A kept teacher
app keeps its first run's name (`<job>-teacher`; Serve's own metrics, the dashboard's teacher queue among them,
follow it) and its replica count; a replica Serve starts in it later (replacing one that died, or scaling up) is
built from its first run's job, then builds the current run's teacher on its first call. A reward judge's app and
vLLM engines (rollout or teacher: device memory and an engine process of their own) start for every run. `close()`
stops what is kept.
"""

from __future__ import annotations

import json
import sys

import ray

from lt_opd_ray.config.pools import ServePool
from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.runtime.learner_group import LearnerGroup, stop_ranks
from lt_opd_ray.runtime.roles import LearnerRole, RayRoles, RewardRole, RolloutRole, TeacherRole
from lt_opd_ray.runtime.rollout_pool import RolloutPool
from lt_opd_ray.runtime.serve_apps import delete_app, deployment_options
from lt_opd_ray.runtime.teacher import TeacherService

END_RUN_TIMEOUT_S = 10.0  # a pool's actors end their run this soon after the driver's stop, or the pool is stopped


def rollout_shape(job: JobConfig) -> tuple | None:
    """What a kept rollout worker must share with the run that takes it over; None: not kept (vLLM)."""
    pool = job.pools.rollout
    if pool.backend != "transformers":
        return None
    return pool.workers, pool.cpus, pool.gpus, tuple(sorted(pool.ray_resources().items()))


def learner_shape(job: JobConfig) -> tuple:
    """What a kept learner rank must share with the run that takes it over: its resources and its process group's
    size (the group's timeout is the job's again once the rank's new engine is built: `learner.Learner`)."""
    pool = job.pools.learner
    return pool.ranks, pool.cpus, pool.gpus, tuple(sorted(pool.ray_resources().items()))


def teacher_shape(job: JobConfig) -> str | None:
    """What a kept teacher app must share with the run that takes it over: its deployment's options (resources,
    replicas or autoscaling bounds, liveness, draining); None: not kept (vLLM), or no teacher."""
    pool = job.pools.teacher
    if pool.backend != "transformers" or not job.objective.teacher_scores:
        return None
    return json.dumps(deployment_options(pool, job), sort_keys=True)


def stopping_on_an_error() -> bool:
    """The driver is being stopped while an exception propagates (a failed run, or its caller's failed check)."""
    return sys.exc_info()[0] is not None


def all_ended(actors: list) -> bool:
    """Every actor ended its run (`end_run`, queued after the run's calls) within END_RUN_TIMEOUT_S."""
    refs = [a.end_run.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=END_RUN_TIMEOUT_S)
    try:
        return len(ready) == len(refs) and all(ray.get(ready))
    except ray.exceptions.RayError:  # one died, or its run's end raised
        return False


class KeptRolloutPool(RolloutPool):
    def __init__(self, job: JobConfig, roles: KeptRoles, kept: list | None):
        super().__init__(job, kept)
        self.roles, self.shape = roles, rollout_shape(job)

    def shutdown(self) -> None:
        if not stopping_on_an_error() and self.replaced == 0 and all_ended(self.workers):
            self.roles.rollouts[self.shape] = self.workers
        else:
            super().shutdown()


class KeptLearnerGroup(LearnerGroup):
    def __init__(self, job: JobConfig, roles: KeptRoles, kept: tuple | None):
        super().__init__(job, kept)
        self.roles, self.shape = roles, learner_shape(job)

    def shutdown(self) -> None:
        if not stopping_on_an_error() and self.interrupted is None and all_ended(self.actors):
            self.roles.learners[self.shape] = (self.placement, self.actors)
        else:
            super().shutdown()


class KeptTeacherService(TeacherService):
    def __init__(self, job: JobConfig, roles: KeptRoles):
        super().__init__(job)
        self.roles, self.shape = roles, teacher_shape(job)

    def shutdown(self) -> None:
        # the replicas need no end of the run: a later run's first call replaces its teacher, and refuses this one's
        from ray import serve

        status = serve.status().applications.get(self.app_name)
        if not stopping_on_an_error() and status is not None and status.status == "RUNNING":
            self.roles.teachers[self.shape] = self
        else:
            super().shutdown()


class KeptRoles(RayRoles):
    """`RayRoles` that keep a sound run's rollout workers, learner ranks and teacher app for the next run of their
    shape."""

    def __init__(self):
        self.rollouts: dict[tuple, list] = {}  # shape -> workers that ended their run
        self.learners: dict[tuple, tuple] = {}  # shape -> (placement group, ranks that ended their run)
        self.teachers: dict[str, KeptTeacherService] = {}  # shape -> the app its last run left
        self.starts = {"rollout": 0, "learner": 0, "teacher": 0}  # pools started in new processes
        self.takeovers = {"rollout": 0, "learner": 0, "teacher": 0}  # pools started in kept ones

    # The driver asks for the Serve apps first, then the rollout workers, then the learners. The kept pools never hold
    # more of the cluster than the last run's did (one per role, stopped where the next run's shape differs); an app
    # the last run did not have may still find no room beside them, and then they are stopped.
    def teacher(self, job: JobConfig) -> TeacherRole:
        shape = teacher_shape(job)
        kept = self.teachers.pop(shape, None)
        self.stop_teachers()
        self._count("teacher", kept)
        if kept is not None:
            return kept.start_run(job)
        self.make_room(job, job.pools.teacher)
        return TeacherService(job) if shape is None else KeptTeacherService(job, self)

    def reward_pool(self, job: JobConfig) -> RewardRole:
        self.make_room(job, job.pools.reward)
        return super().reward_pool(job)

    def rollout_pool(self, job: JobConfig) -> RolloutRole:
        shape = rollout_shape(job)
        kept = self.rollouts.pop(shape, None)
        self.stop_rollouts()
        self.stop_teachers()  # a teacher app this run did not take over (it has none: `teacher` comes first)
        self._count("rollout", kept)
        return RolloutPool(job) if shape is None else KeptRolloutPool(job, self, kept)

    def learner_group(self, job: JobConfig) -> LearnerRole:
        kept = self.learners.pop(learner_shape(job), None)
        self.stop_learners()
        self._count("learner", kept)
        return KeptLearnerGroup(job, self, kept)

    def make_room(self, job: JobConfig, pool: ServePool) -> None:
        """Stop the kept pools `job` cannot take over; then all of them where the cluster's free resources (summed
        over its nodes) cannot hold the app's first replicas beside them."""
        for shape in [s for s in self.rollouts if s != rollout_shape(job)]:
            self.stop_rollouts(shape)
        for shape in [s for s in self.learners if s != learner_shape(job)]:
            self.stop_learners(shape)
        for shape in [s for s in self.teachers if s != teacher_shape(job)]:
            self.stop_teachers(shape)
        one = {"CPU": pool.cpus, "GPU": pool.gpus, **pool.ray_resources()}
        free = ray.available_resources()
        if any(free.get(name, 0.0) < amount * pool.replicas for name, amount in one.items() if amount):
            self.close()

    def _count(self, pool: str, kept) -> None:
        (self.takeovers if kept is not None else self.starts)[pool] += 1

    def stop_rollouts(self, *shapes: tuple) -> None:
        """Stop the kept rollout workers of `shapes` (every shape's without)."""
        for shape in shapes or list(self.rollouts):
            for worker in self.rollouts.pop(shape):
                ray.kill(worker)

    def stop_learners(self, *shapes: tuple) -> None:
        """Stop the kept learner ranks of `shapes` (every shape's without)."""
        for shape in shapes or list(self.learners):
            placement, actors = self.learners.pop(shape)
            stop_ranks(actors, placement, leave=True)

    def stop_teachers(self, *shapes: str) -> None:
        """Delete the kept teacher apps of `shapes` (every shape's without)."""
        for shape in shapes or list(self.teachers):
            delete_app(self.teachers.pop(shape).app_name)

    def close(self) -> None:
        """Stop every kept pool, as `RayRoles`' pools stop."""
        try:
            self.stop_teachers()
        finally:
            try:
                self.stop_learners()
            finally:
                self.stop_rollouts()
