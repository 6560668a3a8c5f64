"""The answer a response commits to: the text inside its first <answer>...</answer> (what evaluations and the
answer rewards read; torch-free, so `lt-opd validate` can check a job's reward without torch)."""

from __future__ import annotations

import re

ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)


def parse_answer(response: str) -> str | None:
    """The text inside the first <answer>...</answer>, lower-cased, or None when the response has none."""
    match = ANSWER.search(response)
    return match.group(1).strip().lower() if match else None
