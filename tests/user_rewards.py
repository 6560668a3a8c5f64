"""A user's own reward, as a job names it (`reward.name: user_rewards:letters`): the suite's Ray clusters put this
folder on their workers' PYTHONPATH, as a user's runtime env would put their module."""

from __future__ import annotations


def letters(samples, responses) -> list[float]:
    """A tenth of the letters in each response: a reward that differs between the tiny models' random responses."""
    return [sum(c.isalpha() for c in response) / 10 for response in responses]


def letters_on_odd_rows(samples, responses) -> list[float]:
    """`letters` where the row's uid ends in an odd number, 1 where it ends in an even one: the even rows' groups
    are flat (every response rewarded alike), as DAPO's dynamic sampling replaces."""
    return [sum(c.isalpha() for c in response) / 10 if int(sample.uid.rsplit("-", 1)[1]) % 2 else 1.0
            for sample, response in zip(samples, responses)]


def letters_but_nan_on_row_3(samples, responses) -> list[float]:
    """`letters`, but NaN for every response to the row whose uid ends in -3: a reward that breaks on one row."""
    return [float("nan") if sample.uid.endswith("-3") else sum(c.isalpha() for c in response) / 10
            for sample, response in zip(samples, responses)]
