"""Seeds that are the same in every process and on every machine."""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, identical across processes and machines (unlike hash())."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# The seeds both rollout backends use, so they select and sample the same tokens for the same job.
def selection_seed(seed: int, update: int, uid: str) -> int:
    """The visual-token selection of prompt `uid` in `update` (the seeded selectors read it; image i adds i)."""
    return stable_seed(seed, update, uid)


def response_seeds(seed: int, update: int, uid: str, n: int) -> list[int]:
    """The sampling seed of each of prompt `uid`'s n responses in `update`."""
    return [stable_seed(seed, update, uid, j) for j in range(n)]


def eval_selection_seed(uid: str) -> int:
    """The selection of an evaluation prompt: the same at every update, so scores compare across a run."""
    return stable_seed("eval", uid)
