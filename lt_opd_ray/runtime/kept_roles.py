"""Roles whose processes outlive a run: the next run of the same pool shape starts in them.

Most of a pool's start is its processes' own: each imports torch, transformers (and a learner rank DeepSpeed), ~5
CPU-seconds, before it loads a model (docs/benchmarks.md, driver start). A series of runs on one cluster (a study's
runs, the test suite's) pays that once per pool with `KeptRoles`: when a run stops, its rollout workers and learner
ranks are kept if it left them sound, and a later run whose pool has the same shape (the actors' resources, the
ranks and their process group's timeout, the rollout backend) takes them over. Each builds the new run's engine,
model, optimizer, reward and metrics in the process it has (`RolloutWorker.start_run`, `LearnerActor.start_run`),
so a run on kept pools computes what it would on new ones (tests/test_runtime.py checks it bit for bit).

A pool is kept only when its run left it sound: no worker stopped or replaced, no call to the learner ranks failed
or given up on, and every actor idle within IDLE_TIMEOUT_S of the run's stop (nothing of the run left running).
Otherwise it is stopped as `RayRoles` stops it. The teacher and a reward judge (Serve apps, one per job) and vLLM
rollout engines (device memory and an engine process of their own) are started for every run. `close()` stops
what is kept.
"""

from __future__ import annotations

import ray

from lt_opd_ray.config.pools import ServePool
from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.runtime.learner_group import LearnerGroup, stop_ranks
from lt_opd_ray.runtime.roles import LearnerRole, RayRoles, RewardRole, RolloutRole, TeacherRole
from lt_opd_ray.runtime.rollout_pool import RolloutPool

IDLE_TIMEOUT_S = 5.0  # a pool's actors must have finished the run's calls this soon after it stopped to be kept


def rollout_shape(job: JobConfig) -> tuple | None:
    """What a kept rollout worker must share with the run that takes it over; None: not kept (vLLM)."""
    pool = job.pools.rollout
    if pool.backend != "transformers":
        return None
    return pool.workers, pool.cpus, pool.gpus, tuple(sorted(pool.ray_resources().items()))


def learner_shape(job: JobConfig) -> tuple:
    """What a kept learner rank must share with the run that takes it over: its resources and process group."""
    pool = job.pools.learner
    return pool.ranks, pool.cpus, pool.gpus, tuple(sorted(pool.ray_resources().items())), job.collective_timeout_s


def all_idle(actors: list) -> bool:
    ready, _ = ray.wait([a.idle.remote() for a in actors], num_returns=len(actors), timeout=IDLE_TIMEOUT_S)
    try:
        return len(ready) == len(actors) and all(ray.get(ready))
    except ray.exceptions.RayError:  # one died
        return False


class KeptRolloutPool(RolloutPool):
    def __init__(self, job: JobConfig, roles: KeptRoles, kept: list | None):
        super().__init__(job, kept)
        self.roles, self.shape = roles, rollout_shape(job)

    def shutdown(self) -> None:
        if self.replaced == 0 and all_idle(self.workers):
            self.roles.rollouts[self.shape] = self.workers
        else:
            super().shutdown()


class KeptLearnerGroup(LearnerGroup):
    def __init__(self, job: JobConfig, roles: KeptRoles, kept: tuple | None):
        super().__init__(job, kept)
        self.roles, self.shape = roles, learner_shape(job)

    def shutdown(self) -> None:
        if self.interrupted is None and all_idle(self.actors):
            self.roles.learners[self.shape] = (self.placement, self.actors)
        else:
            super().shutdown()


class KeptRoles(RayRoles):
    """`RayRoles` that keep a sound run's rollout workers and learner ranks for the next run of their shape."""

    def __init__(self):
        self.rollouts: dict[tuple, list] = {}  # shape -> idle workers
        self.learners: dict[tuple, tuple] = {}  # shape -> (placement group, idle ranks)
        self.starts = {"rollout": 0, "learner": 0}  # pools started in new processes
        self.takeovers = {"rollout": 0, "learner": 0}  # pools started in kept ones

    def teacher(self, job: JobConfig) -> TeacherRole:
        self.make_room(job.pools.teacher)
        return super().teacher(job)

    def reward_pool(self, job: JobConfig) -> RewardRole:
        self.make_room(job.pools.reward)
        return super().reward_pool(job)

    def make_room(self, pool: ServePool) -> None:
        """Stop the kept pools where the cluster has no room beside them for a Serve app's first replicas (an app
        the last run did not have)."""
        one = {"CPU": pool.cpus, "GPU": pool.gpus, **pool.ray_resources()}
        free = ray.available_resources()
        if any(free.get(name, 0.0) < amount * pool.replicas for name, amount in one.items() if amount):
            self.close()

    # One kept pool per role at most: a run whose shape differs stops the kept one before its own starts, so the
    # kept pools never hold more of the cluster than the last run's pools did.
    def rollout_pool(self, job: JobConfig) -> RolloutRole:
        shape = rollout_shape(job)
        kept = self.rollouts.pop(shape, None)
        self.stop_rollouts()
        self._count("rollout", kept)
        return RolloutPool(job) if shape is None else KeptRolloutPool(job, self, kept)

    def learner_group(self, job: JobConfig) -> LearnerRole:
        kept = self.learners.pop(learner_shape(job), None)
        self.stop_learners()
        self._count("learner", kept)
        return KeptLearnerGroup(job, self, kept)

    def _count(self, pool: str, kept) -> None:
        (self.takeovers if kept is not None else self.starts)[pool] += 1

    def stop_rollouts(self) -> None:
        while self.rollouts:
            for worker in self.rollouts.popitem()[1]:
                ray.kill(worker)

    def stop_learners(self) -> None:
        while self.learners:
            placement, actors = self.learners.popitem()[1]
            stop_ranks(actors, placement, leave=True)

    def close(self) -> None:
        """Stop every kept pool, as `RayRoles`' pools stop."""
        self.stop_learners()
        self.stop_rollouts()
