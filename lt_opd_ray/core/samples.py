"""The prompt row every role reads: torch-free, so the schema and the data readers import it without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One prompt: driver -> rollout workers and teacher (the update's samples), and every evaluation."""

    uid: str
    images: tuple[Any, ...]  # one or more, in the order the prompt shows them: each a path, bytes or a PIL image
    question: str
    answer: str | None = None  # what an evaluation checks (exact match on <answer>...</answer>)
    response: str | None = None  # a whole response written for the row (its annotators, another model): sft / fixed_prefix train on it

    def __post_init__(self):
        if not self.images:
            raise ValueError(f"{self.uid}: a prompt row needs at least one image")
