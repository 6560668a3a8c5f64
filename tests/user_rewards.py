"""A user's own reward, as a job names it (`reward.name: user_rewards:letters`): the suite's Ray clusters put this
folder on their workers' PYTHONPATH, as a user's runtime env would put their module."""

from __future__ import annotations


def letters(samples, responses) -> list[float]:
    """A tenth of the letters in each response: a reward that differs between the tiny models' random responses."""
    return [sum(c.isalpha() for c in response) / 10 for response in responses]
