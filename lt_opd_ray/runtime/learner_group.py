"""The learner group as Ray actors in a placement group, and the weight broadcast it drives."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.storage import RunStorage
from lt_opd_ray.core.wire import (
    ActorPlacement,
    LearnerStepResult,
    ScoringRequest,
    WeightsSent,
)
from lt_opd_ray.runtime.group_receiver import GroupReceiver, ScoreRequests, Substitutes
from lt_opd_ray.runtime.resources import first_torch_seed, free_run_memory, placement_here, restart_torch_generators
from lt_opd_ray.runtime.rollout_pool import CONTROL
from lt_opd_ray.runtime.waits import Progress, RoleDiedError, Watched, wait_for, wait_watched

# The learner's own threads beside the step: "control" (liveness, substitutes, sync aborts) and "sync" (forming the
# weight-sync group and sending the weights while a step waits on a replaced worker: `send_weights_inside_step`).
LEARNER_GROUPS = CONTROL | {"sync": 1}
FINISH_TIMEOUT_S = 30.0  # leaving the process group at shutdown
SENDER_END_S = 2.0  # a kept rank's teacher-request thread ends this soon at its run's end, or the rank is not kept


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_work(groups: list, worker_names: list[str], ranks: int) -> list[list[tuple]]:
    """What each rank's step takes as `work`: (worker name, first prompt, group ref) of its own groups
    (`GroupRef.learner_rank`), in prompt order."""
    work = [[] for _ in range(ranks)]
    for group in sorted(groups, key=lambda g: g.start):
        work[group.learner_rank].append((worker_names[group.worker], group.start, group.group))
    return work


def rank_requests(groups: list, ranks: int) -> list[list[tuple]]:
    """What each rank's `request_scores` takes: (group ref, update, first prompt, stop) of its own groups."""
    requests = [[] for _ in range(ranks)]
    for group in groups:
        requests[group.learner_rank].append((group.group, group.update, group.start, group.stop))
    return requests


class LazyTeacherClient:
    """A run's `runtime.teacher.TeacherClient`, made on the rank's first request: a job without a teacher (the RL
    baselines, SFT) never imports Ray Serve in its learners (~1 CPU-second a rank start)."""

    def __init__(self):
        self.client = None

    def __call__(self, scoring: ScoringRequest, group_ref, update: int, start: int, stop: int):
        if self.client is None:
            from lt_opd_ray.runtime.teacher import TeacherClient

            self.client = TeacherClient()
        return self.client(scoring, group_ref, update, start, stop)


class LearnerActor:
    """One DeepSpeed rank; rank 0 also hosts the weight-sync store and sends the weights."""

    def __init__(self, job: JobConfig, rank: int, world: int):
        import transformers

        transformers.logging.set_verbosity_error()
        self.rank, self.world = rank, world
        self.first_seed = first_torch_seed()
        self.learner = None  # set by setup, after the process group exists
        self._run_state(job)

    def _run_state(self, job: JobConfig) -> None:
        """What one run's calls hold, apart from its DeepSpeed engine."""
        from lt_opd_ray.runtime.metrics import LearnerMetrics

        self.job = job
        self.sync_store = None  # rank 0 only: hosts the weight-sync TCPStore
        self.sync = None  # rank 0 only: the current weight-sync group
        self.metrics = LearnerMetrics(job.name, f"learner-{self.rank}")
        self.substitutes = Substitutes()  # groups sampled again after their worker died, by (update, start)
        self.score_requests = ScoreRequests(LazyTeacherClient())  # this rank's groups, sent to the run's teacher as it admits them

    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def request_scores(self, scoring: ScoringRequest, groups: list[tuple]) -> None:
        """Ask the teacher to score these groups of this rank: (ObjectRef[RolloutGroup], update, first prompt, stop)
        each (nested in a list, so Ray hands the refs over unresolved). Returns at once: the requests go out from
        the rank's sender thread as the teacher admits them (`ScoreRequests`), and the step takes their answers."""
        for group_ref, update, start, stop in groups:
            self.score_requests.ask(scoring, group_ref, update, start, stop)

    @ray.method(concurrency_group="control")
    def substitute(self, update: int, start: int, refs: list) -> None:
        """The group of `update` starting at prompt `start`, sampled again after its worker died: `refs` is
        [worker name, ObjectRef[RolloutGroup]] (in a list, so Ray hands the ref over unresolved; its scores are
        asked for by `request_scores`). Answered while a step runs: the step waits for it (GroupReceiver)."""
        self.substitutes.put((update, start), tuple(refs))

    @ray.method(concurrency_group="control")
    def alive(self) -> Progress:
        """The liveness ping, answered from the control thread while a step runs (a frozen process does not answer):
        the step's progress, so one stuck inside a step (a hung kernel or collective) is seen too."""
        learner = self.learner  # None between a kept rank's runs
        return learner.progress.read() if learner is not None else Progress(0, False, "starting")

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> float:
        """Join the process group and build the DeepSpeed engine; returns when it was ready (wall clock)."""
        from lt_opd_ray.runtime.learner import Learner, init_process_group

        init_process_group(self.rank, self.world, master_addr, master_port, self.job.collective_timeout_s)
        self.learner = Learner(self.job, self.rank, self.world)
        return time.time()

    def end_run(self) -> bool:
        """A run's end on a rank kept for another (`runtime/kept_roles.py`), after every call the run queued in the
        default group: its teacher requests not yet sent dropped and their thread ended, its weight-sync group and
        store let go, its DeepSpeed engine destroyed and what it held freed. True where nothing of the run is left
        running in the process."""
        self.score_requests.close()
        self.sync = self.sync_store = None
        if self.learner is not None:
            self.learner.engine.destroy()
            import torch.distributed as dist

            dist.destroy_process_group(self.learner.lockstep)  # every rank ends the run: the next makes its own
        self.learner = None
        free_run_memory()
        self.score_requests.sender.join(timeout=SENDER_END_S)
        return not self.score_requests.sender.is_alive()

    def start_run(self, job: JobConfig) -> float:
        """A kept rank starts the next run (after `end_run`): a new DeepSpeed engine (the job's model, optimizer and
        schedule) in the process group it has, torch's generators where a new process starts them. Returns when it
        was ready."""
        from lt_opd_ray.runtime.learner import Learner

        restart_torch_generators(self.first_seed)
        self._run_state(job)
        self.learner = Learner(job, self.rank, self.world)  # also sets every process group's timeout to the job's
        return time.time()

    def host_weight_sync(self) -> tuple[str, int]:
        from lt_opd_ray.weight_sync.group import host_store

        host, port = ray.util.get_node_ip_address(), free_port()
        self.sync_store = host_store(host, port, 0, self.job.pools.learner.sync_timeout_s)
        return host, port

    @ray.method(concurrency_group="sync")
    def join_weight_sync(self, world: int, generation: int) -> int:
        from lt_opd_ray.runtime.rollout_pool import sync_device
        from lt_opd_ray.weight_sync.group import SyncGroup

        self.sync = SyncGroup(self.sync_store, 0, world, generation, self.job.pools.learner.sync_timeout_s, device=sync_device())
        return 0

    def train_step(self, samples: dict, work: list, total_sequences: int, version: int, scoring: ScoringRequest | None) -> LearnerStepResult:
        """One optimizer step (weights `version` -> `version + 1`) on this rank's groups only, streamed: `work` is
        [(worker name, first prompt, ObjectRef[RolloutGroup])] in prompt order (nested in a list, so Ray hands the
        refs over unresolved), their scores asked for by `request_scores`; `samples`: this rank's prompts by index;
        `scoring`: how to ask again."""
        receiver = GroupReceiver(work, version, self.job, self.rank, self.learner.module.model.config.text_config.vocab_size, scoring,
                                 self.substitutes, self.score_requests)
        result = self.learner.train_step(samples, iter(receiver), total_sequences, version)
        result = dataclasses.replace(
            result, staleness=receiver.staleness, payload_bytes=receiver.payload_bytes, payload_tokens=receiver.payload_tokens,
            teacher_retries=receiver.retries, spans=(*receiver.spans, *result.spans),
        )
        self.metrics.record_step(result)
        return result

    def broadcast_weights(self, version: int) -> WeightsSent:
        """Every rank gathers bucket by bucket (ZeRO-3 is a collective); rank 0 sends each bucket in the wire dtype.

        If the send fails (a member died, the driver aborted the group), rank 0 stops sending but goes on
        gathering to the last bucket, so the learners' own group stays in step, then raises."""
        begin = time.perf_counter()
        bucket_bytes = int(self.job.pools.learner.sync_bucket_mb * 2**20)
        mark, before = self.learner.progress.mark, self.learner.progress.read()  # a step may be waiting (inside_step)
        mark(f"v{version} weight broadcast", working=False)  # paced by the slowest receiver: waiting, not stuck
        try:
            if self.rank == 0:  # the learner is the sync's source (weight_sync/ends.WeightSource)
                nbytes = self.sync.send(self.learner, version, bucket_bytes)
            else:
                nbytes = self.learner.stream_weights(None, bucket_bytes)  # its part of each ZeRO-3 gather
        finally:
            mark(before.doing, before.working)
        seconds = time.perf_counter() - begin
        if self.rank == 0:
            self.metrics.record_sync(seconds, nbytes)
        return WeightsSent(self.rank, nbytes, self.learner.wire_dtype, seconds)

    @ray.method(concurrency_group="sync")
    def send_weights_inside_step(self, version: int) -> WeightsSent:
        """Rank 0, while the step waits for rollouts that no live worker can sample: the weights (`version`, the
        step's own) to the workers that replace the lost ones. Only where the rank holds whole weights (ZeRO 0-2):
        the step leaves them untouched until its optimizer call, which cannot come before those rollouts, so they
        are read from this thread as they are. Under CUDA on a side stream: the step's thread may be blocked in
        the ranks' lockstep all-reduce, and work queued behind it on the current stream would wait for the very
        rollouts these weights are for."""
        import contextlib

        import torch

        if self.rank != 0 or self.job.pools.learner.zero_stage == 3:
            raise ValueError(f"learner-{self.rank} (ZeRO-{self.job.pools.learner.zero_stage}) cannot send the weights inside a step")
        device = self.learner.engine.device
        stream = torch.cuda.stream(torch.cuda.Stream(device)) if torch.device(device).type == "cuda" else contextlib.nullcontext()
        with stream:
            return self.broadcast_weights(version)

    @ray.method(concurrency_group="control")
    def abort_weight_sync(self) -> None:
        """Free a `broadcast_weights` blocked on a member that is gone (rank 0; the others hold no sync group)."""
        if self.sync is not None:
            self.sync.abort()

    def full_state_dict(self) -> dict | None:
        """Rank 0 answers; the other ranks take part in the ZeRO-3 gathers and answer None."""
        return self.learner.full_state_dict()

    def save_pretrained(self, directory: str) -> None:
        self.learner.save_pretrained(directory)

    def save(self, directory: str, tag: str) -> None:
        self.learner.engine.save_checkpoint(directory, tag=tag)

    def load(self, directory: str, tag: str) -> None:
        self.learner.engine.load_checkpoint(directory, tag=tag)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def placement(self) -> ActorPlacement:
        from lt_opd_ray.models.kernels import missing_kernels

        model_type = self.learner.module.model.config.model_type
        return placement_here(f"learner-{self.rank}", f"DeepSpeed ZeRO-{self.job.pools.learner.zero_stage}", missing_kernels(model_type))

    # One rank per node moves its node's checkpoint files between the local staging folder and a URI storage.
    def upload(self, location: str, staging: str | None, local: str, to: str, last: tuple[str, ...] = ()) -> dict[str, list]:
        from lt_opd_ray.runtime.checkpoint import upload

        return upload(RunStorage(location, staging), local, to, last)

    def download(self, location: str, staging: str | None, tag: str) -> None:
        from lt_opd_ray.runtime.checkpoint import download

        download(RunStorage(location, staging), tag)

    def discard(self, folder: str) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def finish(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # without it some gloo runs abort at exit
            dist.destroy_process_group()


class LearnerGroup:
    def __init__(self, job: JobConfig, kept: tuple | None = None):
        """`kept`: (placement group, ranks) of an earlier run whose group had this one's shape (`runtime/kept_roles.py`);
        each rank builds this run's engine in its own process and process group instead of new ranks starting."""
        pool = job.pools.learner
        self.job = job
        self.interrupted: str | None = None  # the call to the ranks that failed or was given up on, if one was
        if kept is not None:
            self.placement, self.actors = kept
            self.starting = [a.start_run.remote(job) for a in self.actors]
            return
        bundle = {"CPU": pool.cpus, **({"GPU": pool.gpus} if pool.gpus else {}), **pool.ray_resources()}
        self.placement = placement_group([bundle] * pool.ranks, strategy="PACK")
        wait_for([self.placement.ready()], ["placement group"], job.schedule.wait_timeout_s, "reserving the learners' resources")
        actor_cls = ray.remote(concurrency_groups=LEARNER_GROUPS)(LearnerActor)
        self.actors = [
            actor_cls.options(
                num_cpus=pool.cpus,
                num_gpus=pool.gpus,
                resources=pool.ray_resources(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank),
            ).remote(job, rank, pool.ranks)
            for rank in range(pool.ranks)
        ]
        master_addr, master_port = self.wait([self.actors[0].address.remote()], "learner-0's address")[0]
        self.starting = [a.setup.remote(master_addr, master_port) for a in self.actors]  # rendezvous: all at once, while the other pools start

    def wait_ready(self) -> float:
        """Wall clock when the last rank was ready."""
        ready = max(self.wait(self.starting, "learner setup"))
        nodes = self.wait([a.node_id.remote() for a in self.actors], "the learners' nodes")
        self.node_ranks = sorted({node: rank for rank, node in reversed(list(enumerate(nodes)))}.values())  # lowest rank per node
        return ready

    def request_scores(self, scoring: ScoringRequest, groups: list) -> None:
        """Each rank asks the teacher to score its own groups (`LearnerActor.request_scores`); returns at once."""
        for actor, mine in zip(self.actors, rank_requests(groups, len(self.actors))):
            if mine:
                actor.request_scores.remote(scoring, mine)

    def async_train_step(self, batch: list, groups: list, worker_names: list[str], version: int, scoring: ScoringRequest | None) -> list:
        """Start one optimizer step (ObjectRef[LearnerStepResult] per rank; `wait` for them); each rank gets only its own
        prompts' samples and groups (`GroupRef.learner_rank`), and trains on each group as it arrives."""
        work = rank_work(groups, worker_names, len(self.actors))
        own_samples = [ray.put({i: batch[i] for i in range(start, stop)}) for start, stop in self.prompt_ranges(len(batch))]
        total = len(batch) * self.job.sampling.n
        return [a.train_step.remote(own, mine, total, version, scoring) for a, own, mine in zip(self.actors, own_samples, work)]

    def wait(self, refs: list, what: str, upstream: list[Watched] | None = None) -> list:
        """Every rank's answer, bounded by schedule.wait_timeout_s (naming the ranks that did not answer). With
        `upstream` (an update's step: the rollout workers it waits on), the ranks and those actors are pinged while it
        waits: one that dies or stops answering is named (waits.wait_watched). Not while the ranks start: a rank
        answers no ping before its process is up. A rank that died is named in a RoleDiedError: a ZeRO group cannot
        go on without one of its ranks."""
        names = [f"learner-{r}" for r in range(len(refs))]
        ranks = [Watched(name, actor.alive.remote, lambda: what) for name, actor in zip(names, self.actors)]
        watched = [*upstream, *ranks] if upstream is not None else []
        try:
            return wait_watched(refs, names, self.job.schedule.wait_timeout_s, what, watched, self.job.schedule.liveness_timeout_s)
        except BaseException as exc:
            self.interrupted = what  # a rank may be left inside a collective that its peers will never join
            if isinstance(exc, ray.exceptions.RayActorError):
                dead = [f"learner-{r}" for r, actor in enumerate(self.actors) if actor._actor_id.hex() == getattr(exc, "actor_id", None)]
                raise RoleDiedError(f"{dead[0] if dead else 'an actor'} died while {what}") from exc
            raise

    @property
    def ranks(self) -> int:
        return len(self.actors)

    def substitute(self, rank: int, update: int, start: int, refs: list) -> None:
        """Hand rank `rank` the group of `update` starting at prompt `start`, sampled again after its worker died
        (`LearnerActor.substitute`: answered while the rank's step waits for it)."""
        self.actors[rank].substitute.remote(update, start, refs)

    def save_state(self, directory: str, tag: str) -> None:
        """Every rank's engine state (weights, optimizer, scheduler) into checkpoint `tag` under `directory`."""
        self.wait([a.save.remote(directory, tag) for a in self.actors], f"writing checkpoint {tag}")

    def load_state(self, directory: str, tag: str) -> None:
        self.wait([a.load.remote(directory, tag) for a in self.actors], f"loading checkpoint {tag}")

    def upload(self, location: str, staging: str | None, local: str, to: str, last: tuple[str, ...] = ()) -> None:
        """Rank 0 uploads its node's folder `local` to the storage's `to` (`LearnerActor.upload`)."""
        self.wait([self.actors[0].upload.remote(location, staging, local, to, last)], f"uploading {to}/")

    def prompt_ranges(self, prompts: int) -> list[tuple[int, int]]:
        """Each rank's [start, stop) of an update's prompts."""
        from lt_opd_ray.core.microbatch import split_evenly

        return split_evenly(prompts, len(self.actors))

    def placements(self) -> list[ActorPlacement]:
        return self.wait([a.placement.remote() for a in self.actors], "the learners' placement")

    def full_state_dict(self) -> dict:
        return self.wait([a.full_state_dict.remote() for a in self.actors], "gathering the weights")[0]

    def on_each_node(self, method: str, *args, what: str) -> list:
        """`method(*args)` on one rank per node (the lowest), for what each node holds on its own disk."""
        return self.wait([getattr(self.actors[rank], method).remote(*args) for rank in self.node_ranks], what)

    def save_pretrained(self, directory: str) -> None:
        """The current student as a Hugging Face folder at `directory` (written by rank 0)."""
        self.wait([a.save_pretrained.remote(directory) for a in self.actors], f"writing {directory}")

    def weights_checksum(self, dtype: str = "float32") -> str:
        """A digest of the learners' weights in `dtype` (the wire dtype compares with the rollout workers')."""
        from lt_opd_ray.weight_sync.layout import WIRE_DTYPES, weights_checksum

        return weights_checksum(self.full_state_dict().items(), WIRE_DTYPES[dtype])

    def shutdown(self) -> None:
        """After a call that failed or was given up on, a rank may sit in a collective (a barrier of a checkpoint
        write one rank failed) that would take the leaving barrier's place: the ranks stop without leaving."""
        stop_ranks(self.actors, self.placement, leave=self.interrupted is None)


def stop_ranks(actors: list, placement, leave: bool) -> None:
    """With `leave`, the ranks leave their process group together (bounded: each must have finished its last call);
    then every rank is killed, whatever state it is in, and its placement group removed."""
    if leave:
        ray.wait([a.finish.remote() for a in actors], num_returns=len(actors), timeout=FINISH_TIMEOUT_S)
    for actor in actors:
        ray.kill(actor)
    ray.util.remove_placement_group(placement)
