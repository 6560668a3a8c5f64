"""Every wait on another role is bounded: a role that does not answer in time is named, never waited on forever."""

from __future__ import annotations

import time

import ray


class NoAnswerError(TimeoutError):
    """An actor did not answer a call within its bound."""


class RoleDiedError(RuntimeError):
    """An actor the run cannot replace in place died; the message names it and what it was doing."""


def wait_for(refs: list, names: list[str], timeout_s: float, what: str, error: type[Exception] = NoAnswerError) -> list:
    """ray.get(refs) once all are ready; `names[i]` is the actor behind refs[i], named if it does not answer in
    `timeout_s`. A call that failed raises its error as soon as it is known, not after the others' bound."""
    deadline = time.monotonic() + timeout_s
    pending = list(dict.fromkeys(refs))
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = sorted({name for ref, name in zip(refs, names) if ref in pending})
            raise error(f"{what}: no answer after {timeout_s:.0f} s from {', '.join(late)}")
        ray.get(ready)
    return ray.get(refs)


def wait_one(ref, name: str, timeout_s: float, what: str):
    return wait_for([ref], [name], timeout_s, what)[0]
