"""Rewards for the RL baselines, as a seam: a reward takes the prompts' rows and the sampled responses and gives one
float per response. Built-ins score the response's answer against the row's (`answer`, `answer_normalised`,
`choice`) or its form (`format`); a job may name its own as `module:function`. Every reward's output is checked
(`checked_rewards`): one finite number per response, or a RewardError naming the reward and the row."""

from __future__ import annotations

import importlib
import math
import numbers
import os
from collections.abc import Callable, Sequence

from lt_opd_ray.config.objective import JUDGE_REWARD
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.evals.scoring import LETTERS, choice_letter, exact_match
from lt_opd_ray.core.answers import ANSWER, parse_answer

Reward = Callable[[Sequence[Sample], Sequence[str]], Sequence[float]]


class RewardError(ValueError):
    """A reward that could not be loaded, or gave something other than one finite number per response."""


def _answers(samples: Sequence[Sample]) -> list[str]:
    missing = [s.uid for s in samples if s.answer is None]
    if missing:
        raise RewardError(f"rows without a reference answer cannot be rewarded by their answer: {', '.join(missing[:5])}")
    return [str(s.answer).strip() for s in samples]


def _is_letter(answer: str) -> bool:
    """One option letter A-J (either case)."""
    return len(answer) == 1 and answer.upper() in LETTERS


def answer_exact(samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
    """1 where the response's <answer> equals the row's answer (case and surrounding space aside), else 0."""
    return [float(parse_answer(r) == a.lower()) for r, a in zip(responses, _answers(samples), strict=True)]


def answer_normalised(samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
    """1 where the response's <answer> equals the row's after the VQA normalisation (punctuation, articles, number words)."""
    return [float((p := parse_answer(r)) is not None and exact_match(p, a)) for r, a in zip(responses, _answers(samples), strict=True)]


def answer_choice(samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
    """1 where the option letter the response commits to is the row's answer letter (A-J)."""
    answers = _answers(samples)
    bad = [s.uid for s, a in zip(samples, answers) if not _is_letter(a)]
    if bad:
        raise RewardError(f"reward choice: rows whose answer is not an option letter A-J: {', '.join(bad[:5])}")
    return [float(choice_letter(r, [""] * len(LETTERS)) == a.upper()) for r, a in zip(responses, answers, strict=True)]


def answer_format(samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
    """1 where the response gives its answer inside <answer>...</answer>, else 0."""
    return [float(ANSWER.search(r) is not None) for r in responses]


BUILT_IN: dict[str, Reward] = {"answer": answer_exact, "answer_normalised": answer_normalised, "choice": answer_choice,
                               "format": answer_format}
READS_ANSWERS = ("answer", "answer_normalised", "choice", JUDGE_REWARD)  # the built-ins that compare with each row's `answer`


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens: 0 up to max_new_tokens - buffer, then falling
    linearly to -1 at max_new_tokens (the longest a response can be)."""
    if buffer == 0 or length <= max_new_tokens - buffer:
        return 0.0
    return -min(length - (max_new_tokens - buffer), buffer) / buffer


def row_problems(name: str, samples: Sequence[Sample], spec: str) -> list[str]:
    """Why the rows of data.path `spec` cannot be rewarded by the built-in `name`, one line per kind of fault (rows
    named); none for a user's own reward, which checks its rows itself."""
    if name not in READS_ANSWERS:
        return []
    shown = lambda uids: f"{', '.join(uids[:3])}{', ...' if len(uids) > 3 else ''}"  # noqa: E731
    if unanswered := [s.uid for s in samples if s.answer is None]:
        return [f"reward.name {name} compares each response with its row's answer, but {len(unanswered)} of the {len(samples)}"
                f" rows of data.path {spec!r} carry none ({shown(unanswered)}): give each row an `answer`"]
    if name == "choice" and (unlettered := [s.uid for s in samples if not _is_letter(str(s.answer).strip())]):
        return [f"reward.name choice reads option letters, but {len(unlettered)} rows of data.path {spec!r} answer otherwise"
                f" ({shown(unlettered)}): use answer or answer_normalised"]
    return []


TRUSTED_MODULES = "LT_OPD_TRUSTED_MODULES"


def trusted_modules() -> set[str]:
    """The modules a job's `module:function` reward may import: the operator's comma-separated list in the
    LT_OPD_TRUSTED_MODULES variable of the process (a local run passes it to its workers; on a cluster, the job's
    runtime env), whole module names only. Nothing else is imported, `lt-opd validate` included."""
    return {m.strip() for m in os.environ.get(TRUSTED_MODULES, "").split(",") if m.strip()}


def load_reward(name: str, judge: Reward | None = None) -> Reward:
    """A built-in reward by name, `judge` (the judge model's answer, as `judge` gives it: its Serve pool's client in
    a run, the model itself in process), or `module:function` importable where the job runs."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    if name == JUDGE_REWARD:
        if judge is None:
            raise RewardError("reward judge: no judge model to ask (reward.judge, served by pools.reward)")
        return judge
    module, _, function = name.partition(":")
    if not module or not function:
        raise RewardError(f"reward {name!r}: one of {', '.join([*BUILT_IN, JUDGE_REWARD])}, or module:function")
    if module not in trusted_modules():  # a job file names code; only the operator's environment lets it run
        raise RewardError(f"reward {name!r} names code to import, and module {module!r} is not among the operator's trusted modules:"
                          f" set {TRUSTED_MODULES}={module} where the job runs (a job file alone never runs code)")
    try:
        found = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise RewardError(f"reward {name!r} cannot be loaded: {exc}") from exc
    if not callable(found):
        raise RewardError(f"reward {name!r} is not callable")
    return found


def checked_rewards(name: str, reward: Reward, samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
    """`reward`'s values for `responses` (the i-th answering `samples[i]`), each a finite number, else a RewardError
    naming the reward and the first row at fault."""
    uids = [s.uid for s in samples]
    given = f"rows {', '.join(uids[:5])}{', ...' if len(uids) > 5 else ''}"
    try:
        values = list(reward(samples, responses))
    except RewardError:
        raise
    except Exception as exc:  # a user's reward failing: named, with the rows it was given
        raise RewardError(f"reward {name} raised {type(exc).__name__}: {exc} ({given})") from exc
    if len(values) != len(responses):  # which value answers which row is unknown: the rows it was given
        raise RewardError(f"reward {name}: {len(values)} values for {len(responses)} responses ({given})")
    for i, value in enumerate(values):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):  # ints, floats, numpy scalars
            raise RewardError(f"reward {name}: response {i} (row {samples[i].uid}) got {value!r}, not a finite number")
    return [float(v) for v in values]


class JobReward:
    """A job's `reward` section as the rollout workers and the reference give it: `reward.name`'s checked score of
    each response against its own row, plus DAPO's overlong punishment where `reward.overlong_buffer` is set."""

    def __init__(self, name: str, overlong_buffer: int = 0, max_new_tokens: int = 0, judge: Reward | None = None):
        self.name, self.reward = name, load_reward(name, judge)
        self.overlong_buffer, self.max_new_tokens = overlong_buffer, max_new_tokens

    @classmethod
    def of(cls, job, judge: Reward | None = None) -> JobReward | None:
        """The job's reward (`judge`: how to ask the judge model, where reward.name is judge); None where it has none."""
        if job.reward.name is None:
            return None
        return cls(job.reward.name, job.reward.overlong_buffer, job.sampling.max_new_tokens, judge)

    def __call__(self, rows: Sequence[Sample], texts: Sequence[str], lengths: Sequence[int]) -> list[float]:
        """One reward per response: `texts[i]` (of `lengths[i]` tokens) answering `rows[i]`."""
        values = checked_rewards(self.name, self.reward, rows, texts)
        return [value + overlong_penalty(n, self.max_new_tokens, self.overlong_buffer) for value, n in zip(values, lengths, strict=True)]
