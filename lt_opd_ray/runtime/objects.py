"""The object store the driver and the waits use: put a value, wait for refs, get them.

Ray's (`RAY_OBJECTS`) in every run. The seam exists so the driver's schedule can be run against in-process roles
(tests/fake_roles.py) whose refs are futures: the calls keep Ray's signatures and Ray's errors (a ref whose actor
died raises `ray.exceptions.RayActorError`, a `get` past its timeout `ray.exceptions.GetTimeoutError`).
"""

from __future__ import annotations

from typing import Any, Protocol

import ray


class ObjectStore(Protocol):
    def put(self, value: Any) -> Any: ...

    def wait(self, refs: list, *, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        """(ready, pending): returns once `num_returns` of `refs` are ready or `timeout` has passed."""

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        """The value of a ref (or a list of values of a list of refs); raises what the call that made it raised."""


class RayObjects:
    def put(self, value: Any) -> ray.ObjectRef:
        return ray.put(value)

    def wait(self, refs: list, *, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        return ray.wait(refs, num_returns=num_returns, timeout=timeout)

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        return ray.get(refs, timeout=timeout)


RAY_OBJECTS = RayObjects()
