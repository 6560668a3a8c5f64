"""Every wait on another role is bounded: a role that does not answer in time is named, never waited on forever."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from lt_opd_ray.runtime.objects import RAY_OBJECTS, ObjectStore


class NoAnswerError(TimeoutError):
    """An actor did not answer a call within its bound."""


class RoleDiedError(RuntimeError):
    """An actor the run cannot replace in place died; the message names it and what it was doing."""


def wait_for(refs: list, names: list[str], timeout_s: float, what: str, error: type[Exception] = NoAnswerError,
             objects: ObjectStore = RAY_OBJECTS) -> list:
    """get(refs) once all are ready; `names[i]` is the actor behind refs[i], named if it does not answer in
    `timeout_s`. A call that failed raises its error as soon as it is known, not after the others' bound."""
    deadline = time.monotonic() + timeout_s
    pending = list(dict.fromkeys(refs))
    while pending:
        ready, pending = objects.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = sorted({name for ref, name in zip(refs, names) if ref in pending})
            raise error(f"{what}: no answer after {timeout_s:.0f} s from {', '.join(late)}")
        objects.get(ready)
    return objects.get(refs)


def wait_any(refs: list, names: list[str], timeout_s: float, what: str, error: type[Exception] = NoAnswerError,
             objects: ObjectStore = RAY_OBJECTS) -> dict[int, object]:
    """{i: get(refs[i])} for the refs ready as soon as any is (at least one; every other one done by then too);
    `names[i]` is the actor behind refs[i], named if none answers in `timeout_s`. A call that failed raises its error."""
    first, _ = objects.wait(list(refs), num_returns=1, timeout=timeout_s)
    if not first:
        raise error(f"{what}: no answer after {timeout_s:.0f} s from {', '.join(sorted(set(names)))}")
    done, _ = objects.wait(list(refs), num_returns=len(refs), timeout=0)
    ready = [i for i, ref in enumerate(refs) if ref in done]
    return dict(zip(ready, objects.get([refs[i] for i in ready])))


def wait_one(ref, name: str, timeout_s: float, what: str, objects: ObjectStore = RAY_OBJECTS):
    return wait_for([ref], [name], timeout_s, what, objects=objects)[0]


LIVENESS_TICK_S = 5.0  # how often a watched wait pings the actors it depends on


@dataclass(frozen=True)
class Progress:
    """What a ping answers where the actor reports progress: a count its work advances at each step, whether that step
    is its own work (True) or a wait on another role or rank (False), and what the step is. An actor that answers
    but stays at one working step longer than the liveness bound is stuck inside it (a hung kernel or collective)."""

    count: int
    working: bool
    doing: str


class ProgressMark:
    """An actor's current Progress: `mark` from the thread doing the work, `read` from the control thread (one
    reference swapped under the GIL: a read sees a whole record)."""

    def __init__(self) -> None:
        self._now = Progress(0, False, "idle")

    def mark(self, doing: str, working: bool = True) -> None:
        self._now = Progress(self._now.count + 1, working, doing)

    def read(self) -> Progress:
        return self._now


@dataclass
class Watched:
    """An actor a wait depends on: `ping()` starts a call it answers from its control thread while its long call
    runs (with a Progress where the actor reports one, otherwise anything); `doing()` says what the wait needs from it, or None once it needs nothing more (then it is not pinged);
    `recover(why)`, where the actor can be done without, stops it and hands its work elsewhere or to a replacement
    (True), or says it cannot (False); `why` is what happened to it, for the line the recovery prints."""

    name: str
    ping: Callable[[], object]  # () -> ObjectRef
    doing: Callable[[], str | None]
    recover: Callable[[str], bool] | None = None


def wait_watched(refs: list, names: list[str], timeout_s: float, what: str, watched: list[Watched], liveness_s: float,
                 objects: ObjectStore = RAY_OBJECTS) -> list:
    """`wait_for`, and while it waits every watched actor is pinged each LIVENESS_TICK_S: one that died is named in
    a RoleDiedError, one that has not answered for `liveness_s`, or has answered from one working step (Progress) for
    that long, in a NoAnswerError, each with what it was doing, instead of the actors waiting downstream of it being
    named when the bound runs out."""
    now = time.monotonic()
    deadline = now + timeout_s
    watched = list(watched)
    last = {w.name: now for w in watched}
    moved: dict[str, tuple[Progress, float]] = {}  # per actor reporting progress: its last Progress, seen since when
    pings = {w.name: w.ping() for w in watched}
    pending = list(dict.fromkeys(refs))
    while pending:
        ready, pending = objects.wait(pending, num_returns=len(pending), timeout=max(0.0, min(LIVENESS_TICK_S, deadline - time.monotonic())))
        failures = []
        for ref in ready:  # a call that failed raises at once
            try:
                objects.get(ref)
            except Exception as exc:  # noqa: BLE001 - judged below
                failures.append(exc)
        if failures:  # a dead actor explains its victims' failures (a peer's "connection closed"): name the one that died
            dead = _first_dead(watched, pings, objects)
            if dead is not None:
                raise RoleDiedError(f"{dead.name} died while {_doing(dead.doing() or 'in use', what)}") from failures[0]
            raise next((f for f in failures if isinstance(f, ray.exceptions.RayActorError)), failures[0])
        now = time.monotonic()
        stuck: list[str] = []  # answering, but at one working step for longer than the bound
        for w in watched:
            if (doing := w.doing()) is None:
                continue
            if objects.wait([pings[w.name]], timeout=0)[0]:
                try:
                    answer = objects.get(pings[w.name])
                except ray.exceptions.RayActorError as exc:
                    if w.recover is not None and w.recover(f"died while {doing}"):
                        _recovered(watched, last, pings)
                        continue
                    raise RoleDiedError(f"{w.name} died while {_doing(doing, what)}") from exc
                last[w.name], pings[w.name] = now, w.ping()
                if isinstance(answer, Progress):
                    before, since = moved.get(w.name, (None, now))
                    if before is None or answer.count != before.count or not answer.working:  # moved on, or waits on others
                        moved[w.name] = (answer, now)
                    elif now - since > liveness_s:
                        stuck.append(f"{w.name} ({answer.doing})")
            elif now - last[w.name] > liveness_s:
                if w.recover is not None and w.recover(f"silent for {now - last[w.name]:.0f} s while {doing}"):
                    _recovered(watched, last, pings)
                    continue
                raise NoAnswerError(f"{w.name} stopped answering while {_doing(doing, what)}; last answer {now - last[w.name]:.0f} s ago"
                                    f" (schedule.liveness_timeout_s {liveness_s:g})")
        if stuck:
            raise NoAnswerError(f"{', '.join(stuck)} answered but made no progress for over {liveness_s:g} s while {what}"
                                " (schedule.liveness_timeout_s): stuck inside that step (a hung kernel or collective)")
        if pending and now >= deadline:
            late = sorted({name for ref, name in zip(refs, names) if ref in pending})
            raise NoAnswerError(f"{what}: no answer after {timeout_s:.0f} s from {', '.join(late)}")
    return objects.get(refs)


def _recovered(watched: list[Watched], last: dict, pings: dict) -> None:
    """After a `recover()`: every watched actor is pinged afresh (a `ping` reaches whichever actor now does that
    work: a replacement), and one whose work went elsewhere is skipped while its `doing()` says None."""
    now = time.monotonic()
    for w in watched:
        last[w.name], pings[w.name] = now, w.ping()


def _doing(doing: str, what: str) -> str:
    """What the actor was doing, and the wait that depended on it where that is another thing."""
    return doing if doing == what else f"{doing} ({what} waited on it)"


def _first_dead(watched: list[Watched], pings: dict, objects: ObjectStore, timeout_s: float = LIVENESS_TICK_S) -> Watched | None:
    """The first watched actor still needed whose ping fails as a dead actor's does (each given up to `timeout_s`)."""
    for w in watched:
        if w.doing() is None:
            continue
        try:
            objects.get(pings[w.name], timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return w
        except ray.exceptions.GetTimeoutError:
            continue
    return None


def in_words(exc: BaseException) -> str:
    """One line for an error: the exception an actor raised, named with the actor's method, not Ray's wrapper (whose
    text carries the remote traceback and terminal colour codes)."""

    def plain(text: str) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", text)

    where = ""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        called = re.search(r"ray::([\w.]+)\(", plain(str(exc)))  # Ray's first line: "ray::RolloutWorker.evaluate() (pid=..."
        where, exc = f" in {called[1]}" if called else "", exc.cause
    first = plain((str(exc).strip().splitlines() or [""])[0])[:300]
    return f"{type(exc).__name__}{where}: {first}"
