"""A learner rank's micro-batches as its rollout groups stream in: each group's rollouts packed (in prompt order)
within the token budget as they arrive, never across two mini-batches, with their teacher scores waited for only
when the loss asks for them and, for an RL baseline, each prompt's advantages and old policy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lt_opd_ray.core.microbatch import MicroBatch, Packer, Sequence
from lt_opd_ray.core.wire import Rollout, TeacherScore
from lt_opd_ray.models.loss import PolicyInputs, group_policy_inputs, reduced_length, trained_count
from lt_opd_ray.models.processor import PromptInputs


@dataclass
class StreamedGroup:
    """One rollout group as the learner receives it: its rollouts, and its teacher scores when they are asked for."""

    rollouts: list[Rollout]
    wait_scores: Callable[[], list[TeacherScore]] | None  # waits (bounded) for the teacher's answer; called once. None: no teacher
    lag: int = 0  # weight versions between the learner and the weights that sampled it


class MicroBatchStream:
    """This rank's micro-batches, packed as its groups' rollouts arrive (in prompt order) within the token budget;
    their teacher scores are waited for only when `scores` asks for them.

    Each sequence is its reduced prompt (the replayed selection) plus its response. Iterating yields
    (mini-batch, MicroBatch) pairs, and (mini-batch, None) once that mini-batch's last prompt is packed: a micro-batch
    never spans two mini-batches (`mini_batch`: each of the rank's prompts -> its optimizer step).
    """

    def __init__(self, groups: Iterator[StreamedGroup], encode, token_budget: int, policy_gradient: bool, mini_batch: dict[int, int],
                 packed: bool = False, scale_advantages: bool = True, leave_flat_out: bool = False):
        """`leave_flat_out` (dynamic sampling): a prompt whose rewards are all equal takes no part in the step
        (models/loss.group_policy_inputs)."""
        self.groups, self.encode, self.policy_gradient, self.mini_batch = groups, encode, policy_gradient, mini_batch
        self.scale_advantages, self.leave_flat_out = scale_advantages, leave_flat_out
        self.packer = Packer(token_budget, packed)
        self.rollouts: list[Rollout] = []
        self.prompts: dict[int, PromptInputs] = {}
        self._groups: list[StreamedGroup] = []
        self._firsts: list[int] = []  # per group: the index of its first sequence
        self._owners: list[int] = []  # per sequence: its group
        self._scores: dict[int, list[TeacherScore]] = {}  # per group, once waited for
        self.lengths: list[tuple[int, ...]] = []  # per prompt, in the order packed: its sequences' tokens
        self._policy: dict[int, tuple[float, torch.Tensor | None, float]] = {}  # per sequence (RL baselines): advantage, old policy, trained

    def scores(self, sequences: tuple[int, ...]) -> list[TeacherScore] | None:
        """The teacher's scores of these sequences, waiting for each of their groups' answers the first time; None
        where the job asks no teacher (its objective reads no teacher scores)."""
        owners = dict.fromkeys(self._owners[i] for i in sequences)
        if any(self._groups[g].wait_scores is None for g in owners):
            return None
        for g in owners:
            if g not in self._scores:
                self._scores[g] = self._groups[g].wait_scores()
        return [self._scores[self._owners[i]][i - self._firsts[self._owners[i]]] for i in sequences]

    def policy(self, sequences: tuple[int, ...]) -> PolicyInputs | None:
        """What an RL baseline's loss reads of these sequences (their advantages within their prompts' groups, their
        old policy); None for the other objectives."""
        if not self.policy_gradient:
            return None
        advantages, old_logp, trained = zip(*(self._policy[i] for i in sequences))
        return PolicyInputs(torch.tensor(advantages), list(old_logp), torch.tensor(trained))

    def trained_count(self, objective, sequences: list[int]) -> int:
        """What these sequences count in the step's normaliser (models/loss.trained_count): those of a prompt left out
        of the step count nothing."""
        trained = [self._policy[i][2] for i in sequences] if self.policy_gradient else [1.0] * len(sequences)
        return trained_count(objective, [self.rollouts[i] for i in sequences], trained)

    def compares_with_starting_weights(self, sequences: tuple[int, ...]) -> bool:
        """Whether any of these sequences takes the weights the update starts from as its old policy (sampled by them)."""
        return any(self._policy[i][1] is None for i in sequences)

    def __iter__(self) -> Iterator[tuple[int, MicroBatch | None]]:
        left = {k: list(self.mini_batch.values()).count(k) for k in set(self.mini_batch.values())}  # prompts to come, per mini-batch
        for group in self.groups:
            first = len(self.rollouts)
            self.rollouts += group.rollouts
            self._owners += [len(self._groups)] * len(group.rollouts)
            self._groups.append(group)
            self._firsts.append(first)
            new = sorted({r.prompt_index for r in group.rollouts} - self.prompts.keys())
            self.prompts.update(zip(new, self.encode(new)))
            by_prompt: dict[int, list[Sequence]] = {}
            for i, r in enumerate(group.rollouts, start=first):
                length = reduced_length(self.prompts[r.prompt_index], r.selected) + r.response_ids.numel()
                by_prompt.setdefault(r.prompt_index, []).append(Sequence(i, r.prompt_index, length))
            for prompt in sorted(by_prompt):
                sequences = by_prompt[prompt]
                if self.policy_gradient:  # a prompt's sampling.n rollouts arrive together, in one group
                    inputs = group_policy_inputs([self.rollouts[s.index] for s in sequences], group.lag == 0, self.scale_advantages,
                                                 self.leave_flat_out)
                    self._policy.update({s.index: (float(a), old, float(t))
                                         for s, a, old, t in zip(sequences, inputs.advantages, inputs.old_logp, inputs.trained)})
                self.lengths.append(tuple(s.tokens for s in sequences))
                k = self.mini_batch[prompt]
                yield from ((k, batch) for batch in self.packer.add(sequences))
                left[k] -= 1
                if left[k] == 0:
                    yield from ((k, batch) for batch in self.packer.flush())
                    yield k, None
        if any(left.values()):
            missing = sorted(p for p, k in self.mini_batch.items() if p not in self.prompts)
            raise ValueError(f"this rank's groups ended without the rollouts of its prompts {missing}")


def chain(first, rest: Iterator):
    yield first
    yield from rest


def until_end_of(source: Iterator[tuple[int, MicroBatch | None]], k: int) -> Iterator[MicroBatch]:
    """Mini-batch k's micro-batches from the stream, up to its end marker."""
    for mini_batch, batch in source:
        if mini_batch != k:
            raise ValueError(f"mini-batch {mini_batch} arrived inside mini-batch {k}")
        if batch is None:
            return
        yield batch

