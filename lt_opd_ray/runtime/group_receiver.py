"""A learner rank's intake: the teacher asked to score its groups (from a thread of its own, as the driver submits
them), its groups in prompt order, each waited for (bounded) as the step needs it, checked (its update, its rank,
the staleness bound), a group whose worker died taken from the driver's substitute, and a teacher answer lost with
its replica asked for again."""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from collections.abc import Callable

import ray

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.wire import RolloutGroup, ScoringRequest, StaleRolloutError, unpack_scores
from lt_opd_ray.runtime.objects import RAY_OBJECTS, ObjectStore
from lt_opd_ray.runtime.waits import NoAnswerError, wait_one

TEACHER_RETRIES = 2  # a scoring request is sent again at most this often when its replica dies


class Substitutes:
    """Groups sampled again for a learner rank after their worker died, put by the driver (from the actor's control
    thread) and taken by the step's GroupReceiver (which waits for one, bounded)."""

    def __init__(self):
        self._ready = threading.Condition()
        self._refs: dict[tuple[int, int], tuple] = {}

    def put(self, key: tuple[int, int], refs: tuple) -> None:
        with self._ready:
            self._refs[key] = refs
            self._ready.notify_all()

    def take(self, key: tuple[int, int], timeout_s: float) -> tuple | None:
        with self._ready:
            self._ready.wait_for(lambda: key in self._refs, timeout=timeout_s)
            return self._refs.pop(key, None)


class ScoreRequests:
    """A learner rank's requests to the teacher, sent oldest update first (in the order asked for within one) from a
    thread of their own, each as
    soon as the teacher admits it (a Serve request waits for a replica with a free slot, and holds the slot while
    the replica awaits its group's rollouts): the driver hands an update's groups over and goes on, and the rank's
    step takes each answer's ref when it needs the scores. Refs are kept by group (an ObjectRef is equal to its
    copies) until taken, or dropped with their update (`forget_before`)."""

    def __init__(self, send: Callable[[ScoringRequest, object, int, int, int], object]):
        self.send = send  # (scoring, group ref, update, start, stop) -> ref to the TeacherPayload; blocks until admitted
        self._asked: queue.PriorityQueue = queue.PriorityQueue()  # the oldest update's first: a group sampled again
        self._asked_count = itertools.count()  # for a lost worker goes ahead of the next update's requests
        self._ready = threading.Condition()
        self._answers: dict = {}  # group ref -> (update, payload ref, or the error sending it raised)
        self.sender = threading.Thread(target=self._sender, name="score-requests", daemon=True)
        self.sender.start()

    def ask(self, scoring: ScoringRequest, group_ref, update: int, start: int, stop: int) -> None:
        self._asked.put((update, next(self._asked_count), (scoring, group_ref, start, stop)))

    def close(self) -> None:
        """The run is over (its rank is kept for another): the requests not yet sent are dropped, the answers not
        taken let go, and the sender thread ends once the request it may be sending returns."""
        while True:
            try:
                self._asked.get_nowait()
            except queue.Empty:
                break
        self._asked.put((float("-inf"), next(self._asked_count), None))
        with self._ready:
            self._answers.clear()

    def _sender(self) -> None:
        while True:
            update, _, request = self._asked.get()
            if request is None:
                return
            scoring, group_ref, start, stop = request
            try:
                answer = self.send(scoring, group_ref, update, start, stop)
            except Exception as exc:  # noqa: BLE001 - raised where the step takes it, naming the group
                answer = exc
            with self._ready:
                self._answers[group_ref] = (update, answer)
                self._ready.notify_all()

    def take(self, group_ref, timeout_s: float):
        """The payload ref of the group's request, once the teacher has admitted it; None after `timeout_s`."""
        with self._ready:
            if not self._ready.wait_for(lambda: group_ref in self._answers, timeout=timeout_s):
                return None
            _, answer = self._answers.pop(group_ref)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def forget_before(self, update: int) -> None:
        """Drop the answers of earlier updates never taken (groups sampled again after their worker died)."""
        with self._ready:
            self._answers = {ref: answer for ref, answer in self._answers.items() if answer[0] >= update}


class GroupReceiver:
    """A learner rank's groups in prompt order, each one's rollouts and then its teacher scores waited for (bounded)
    as they are needed.

    Checks every group before it is trained on: it belongs to this update and rank, and its sampling weights are
    at most `schedule.max_staleness` versions behind the learner's (vocab: not lm_head.shape, a ZeRO-3 shard is empty).
    """

    def __init__(self, work: list, version: int, job: JobConfig, rank: int, vocab_size: int, scoring: ScoringRequest | None,
                 substitutes: Substitutes, requests: ScoreRequests, objects: ObjectStore = RAY_OBJECTS):
        self.work, self.version, self.rank, self.vocab_size, self.scoring = work, version, rank, vocab_size, scoring
        self.substitutes, self.requests, self.objects = substitutes, requests, objects
        self.max_staleness, self.timeout_s = job.schedule.max_staleness, job.schedule.wait_timeout_s
        self.staleness = self.payload_bytes = self.payload_tokens = self.retries = 0
        self.spans: list = []
        requests.forget_before(version)

    def __iter__(self):
        from lt_opd_ray.runtime.micro_batch_stream import StreamedGroup

        me = f"learner-{self.rank}"
        for worker, start, group_ref in self.work:
            what = f"{me} waiting for a rollout group of update {self.version}"
            while True:
                try:
                    group = wait_one(group_ref, worker, self.timeout_s, what, self.objects)
                    break
                except ray.exceptions.RayActorError:  # its worker died: the driver samples it again (another worker, a replacement)
                    refs = self.substitutes.take((self.version, start), self.timeout_s)
                    if refs is None:
                        raise
                    worker, group_ref = refs
            lag = self.check(group)
            self.spans.append(group.span)
            yield StreamedGroup(group.rollouts, functools.partial(self.scores, group, group_ref) if self.scoring is not None else None, lag)

    def scores(self, group: RolloutGroup, group_ref) -> list:
        """The teacher's scores of `group`, waited for (bounded) and checked against its rollouts."""
        what = f"learner-{self.rank} waiting for the teacher's scores of {group.worker}'s group"
        payload_ref = self.requests.take(group_ref, self.timeout_s)
        if payload_ref is None:
            raise NoAnswerError(f"{what}: the teacher admitted no request for it in {self.timeout_s:.0f} s")
        payload = self.payload(payload_ref, group_ref, group, what)
        scores = unpack_scores(payload, group.rollouts, self.vocab_size, source=payload.replica or "teacher")
        self.payload_bytes += payload.nbytes
        self.payload_tokens += int(payload.lengths.sum())
        self.spans += payload.spans
        return scores

    def payload(self, payload_ref, group_ref, group: RolloutGroup, what: str):
        """The teacher's answer; when the replica serving it died, the request again (Serve restarts replicas), at
        most TEACHER_RETRIES times (from this thread: the step waits on it anyway)."""
        for attempt in range(TEACHER_RETRIES + 1):
            try:
                return wait_one(payload_ref, "teacher", self.timeout_s, what, self.objects)
            except ray.exceptions.RayActorError as exc:
                if attempt == TEACHER_RETRIES:
                    raise RuntimeError(f"{what}: the teacher replica died {attempt + 1} times on this request ({type(exc).__name__})") from exc
                self.retries += 1
                payload_ref = self.requests.send(self.scoring, group_ref, group.update, group.start, group.stop)

    def check(self, group: RolloutGroup) -> int:
        """The group's lag (learner version - sampling version), once it is checked."""
        where = f"rollout group of prompts {group.start}-{group.stop - 1} from {group.worker}"
        if group.update != self.version or group.learner_rank != self.rank:
            raise ValueError(f"learner-{self.rank} at update {self.version} was sent the {where} for update {group.update}, rank {group.learner_rank}")
        if group.weights_version is None:
            raise StaleRolloutError(f"the {where} was sampled while its worker's weights were half written")
        lag = self.version - group.weights_version
        if not 0 <= lag <= self.max_staleness:
            raise StaleRolloutError(
                f"the {where} was sampled by weights v{group.weights_version}; learner-{self.rank} is at v{self.version}"
                f" and schedule.max_staleness is {self.max_staleness}"
            )
        self.staleness = max(self.staleness, lag)
        return lag
