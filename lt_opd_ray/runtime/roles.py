"""What the driver calls on each role, as small protocols, and where the roles come from.

The driver (`runtime/driver.py`) holds a rollout pool, a teacher service, a learner group and a weight broadcaster,
and passes refs between them through an object store (`runtime/objects.py`). `RayRoles` starts the real ones: Ray
actors, a Serve app, a DeepSpeed group in a placement group. tests/fake_roles.py starts in-process ones that keep
the same contracts (calls answered in order per actor, refs that raise Ray's errors when their actor dies), so the
schedule runs in seconds: staleness 0 and 1, groups lost, refusals, checkpoints with groups in flight.
"""

from __future__ import annotations

from typing import Any, Protocol

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.wire import ActorPlacement, BenchmarkResult, EvalResult, ScoringRequest, SyncResult, TeacherRun
from lt_opd_ray.runtime.learner_group import LearnerGroup
from lt_opd_ray.runtime.objects import RAY_OBJECTS, ObjectStore
from lt_opd_ray.runtime.preflight import preflight
from lt_opd_ray.runtime.reward_pool import RewardService
from lt_opd_ray.runtime.rollout_pool import GroupRef, RolloutPool
from lt_opd_ray.runtime.sync_coordinator import WeightBroadcaster
from lt_opd_ray.runtime.teacher import TeacherService
from lt_opd_ray.runtime.waits import Watched


class RolloutRole(Protocol):
    """The rollout workers (`runtime/rollout_pool.RolloutPool`), addressed by index."""

    names: list[str]

    def wait_ready(self) -> float: ...
    def placements(self) -> list[ActorPlacement]: ...

    def submit(self, samples_ref, budget_bps: int, update: int, learner_ranges: list[tuple[int, int]], group_prompts: int) -> list[GroupRef]:
        """Queue every group of an update over the workers, in the order the learners consume them."""

    def submit_group(self, samples_ref, start: int, stop: int, rank: int, budget_bps: int, update: int, worker: int) -> GroupRef: ...

    def submit_groups(self, samples_ref, bounds: list[tuple[int, int, int]], budget_bps: int, update: int, workers: list[int]) -> list[GroupRef]:
        """Queue these groups (start, stop, learner rank), dealt over `workers` (dynamic sampling's rounds)."""
    def wait(self, refs: list, names: list[str], what: str) -> list: ...
    def ping(self, index: int) -> Any: ...
    def stop(self, index: int) -> None: ...
    def replace(self, index: int) -> None: ...
    def dead_workers(self) -> list[int]: ...
    def evaluate(self, samples_ref, budget_bps: int, selectors: list[str]) -> list[EvalResult]: ...
    def evaluate_benchmarks(self, benchmarks_ref, names: list[str], budget_bps: int, selectors: list[str]) -> list[BenchmarkResult]: ...
    def shutdown(self) -> None: ...


class TeacherRole(Protocol):
    """The frozen teacher (`runtime/teacher.TeacherService`); the learner ranks send it their groups."""

    app_name: str
    run: TeacherRun  # the run its requests belong to (an app kept for later runs serves several)

    def wait_ready(self) -> float: ...
    def replicas(self, max_age_s: float = 0.0) -> int: ...
    def placements(self) -> list[ActorPlacement]: ...
    def shutdown(self) -> None: ...


class RewardRole(Protocol):
    """The reward's judge (`runtime/reward_pool.RewardService`); the rollout workers ask it."""

    app_name: str

    def wait_ready(self) -> float: ...
    def placements(self) -> list[ActorPlacement]: ...
    def shutdown(self) -> None: ...


class LearnerRole(Protocol):
    """The learner ranks (`runtime/learner_group.LearnerGroup`)."""

    @property
    def ranks(self) -> int: ...

    def wait_ready(self) -> float: ...
    def placements(self) -> list[ActorPlacement]: ...
    def prompt_ranges(self, prompts: int) -> list[tuple[int, int]]: ...

    def request_scores(self, scoring: ScoringRequest, groups: list[GroupRef]) -> None:
        """Each group's learner rank asks the teacher to score it, as the teacher admits requests; returns at once."""

    def async_train_step(self, batch: list[Sample], groups: list[GroupRef], worker_names: list[str], version: int,
                         scoring: ScoringRequest | None) -> list:
        """Start one optimizer step: a ref to each rank's LearnerStepResult (`scoring` None: the job has no teacher)."""

    def wait(self, refs: list, what: str, upstream: list[Watched] | None = None) -> list: ...
    def substitute(self, rank: int, update: int, start: int, refs: list) -> None: ...
    def save_state(self, directory: str, tag: str) -> None: ...
    def load_state(self, directory: str, tag: str) -> None: ...
    def on_each_node(self, method: str, *args, what: str) -> list: ...
    def upload(self, location: str, staging: str | None, local: str, to: str, last: tuple[str, ...] = ()) -> None: ...
    def save_pretrained(self, directory: str) -> None: ...
    def shutdown(self) -> None: ...


class BroadcastRole(Protocol):
    """The weight broadcast's control plane (`runtime/sync_coordinator.WeightBroadcaster`)."""

    replaced: list[str]  # workers replaced after dying mid-broadcast, in order

    def connect(self) -> None: ...
    def broadcast(self, version: int) -> SyncResult: ...
    def broadcast_inside_step(self, version: int) -> SyncResult: ...


class Roles(Protocol):
    """Where the driver's roles come from, and the checks that run before any of them starts."""

    objects: ObjectStore

    def preflight(self, job: JobConfig) -> tuple[list[Sample], dict, list[Sample] | None]: ...
    def rollout_pool(self, job: JobConfig) -> RolloutRole: ...
    def learner_group(self, job: JobConfig) -> LearnerRole: ...
    def teacher(self, job: JobConfig) -> TeacherRole: ...
    def reward_pool(self, job: JobConfig) -> RewardRole: ...
    def broadcaster(self, learners: LearnerRole, rollouts: RolloutRole, timeout_s: float) -> BroadcastRole: ...


class RayRoles:
    """The real roles, on the Ray cluster this process is connected to."""

    objects = RAY_OBJECTS

    def preflight(self, job: JobConfig) -> tuple[list[Sample], dict, list[Sample] | None]:
        return preflight(job)

    def rollout_pool(self, job: JobConfig) -> RolloutRole:
        return RolloutPool(job)

    def learner_group(self, job: JobConfig) -> LearnerRole:
        return LearnerGroup(job)

    def teacher(self, job: JobConfig) -> TeacherRole:
        return TeacherService(job)

    def reward_pool(self, job: JobConfig) -> RewardRole:
        return RewardService(job)

    def broadcaster(self, learners: LearnerRole, rollouts: RolloutRole, timeout_s: float) -> BroadcastRole:
        return WeightBroadcaster(learners, rollouts, timeout_s)


RAY_ROLES = RayRoles()
