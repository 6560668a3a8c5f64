"""The prompt row every role reads: torch-free, so the schema and the data readers import it without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One prompt: driver -> rollout workers and teacher (the update's samples), and every evaluation."""

    uid: str
    image: Any  # a path, bytes or a PIL image
    question: str
    answer: str | None = None
