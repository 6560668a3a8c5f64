"""The single-process reference LT-OPD update: the ground truth the distributed runtime reproduces.

One update = student rollouts at budget r(c) with the selector -> teacher top-k
scores on the full-token prompt -> student loss on the replayed reduced input ->
one clipped AdamW step (one per mini-batch, optimizer.steps_per_update, split as the learner ranks split it). Student and teacher start from the same checkpoint; the
teacher is frozen. With schedule.max_staleness 1 it runs the lagged schedule of the
distributed runtime: update c's rollouts are sampled by the weights of update
c - 1 (the initial weights for c = 0 and 1), kept in a second copy of the student.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.curriculum import BudgetSchedule
from lt_opd_ray.core.dynamic_sampling import is_flat, reserve_rows
from lt_opd_ray.core.microbatch import update_mini_batches
from lt_opd_ray.core.optim import build_optimizer
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.selectors import build_selector
from lt_opd_ray.engines.rollout_engines import response_texts, sampling_params
from lt_opd_ray.engines.transformers.rollout import rollout
from lt_opd_ray.engines.transformers.teacher import teacher_scores
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.loading import compute_precision, load_vlm
from lt_opd_ray.evals.judge import Judge
from lt_opd_ray.evals.rewards import JobReward
from lt_opd_ray.models.loss import (
    LossStats,
    PolicyInputs,
    group_policy_inputs,
    sampled_log_probs,
    student_forward,
    student_loss,
    trained_count,
    update_normaliser,
    with_old_log_probs,
)
from lt_opd_ray.models.processor import VLMProcessor, encode_samples
from lt_opd_ray.sources.resolve import resolve_model_dir


@dataclass
class StepReport:
    step: int
    budget_bps: int
    stats: LossStats
    grad_norm: float
    mean_response_tokens: float
    reward_mean: float | None = None  # where the job has a reward
    resampled_groups: int | None = None  # dynamic sampling (reward.dynamic_sampling_rounds): prompts given to new rows
    flat_groups: int | None = None  # dynamic sampling: prompts still flat after the last round


class ReferenceTrainer:
    """Student, frozen teacher and optimizer in one process. `rows`: the training rows dynamic sampling draws new
    prompts from (reward.dynamic_sampling_rounds)."""

    def __init__(self, job: JobConfig, rows: list[Sample] | None = None):
        if job.reward.dynamic_sampling_rounds and not rows:
            raise ValueError("reward.dynamic_sampling_rounds draws new prompts from the training rows: pass them as `rows`")
        self.job, self.rows = job, rows
        model_dir, model = load_vlm(resolve_model_dir(job.model.path), token_merge=job.selector.merge == "learnable")
        torch.manual_seed(job.seed)
        self.processor = VLMProcessor.for_data(model_dir, job.data)
        self.student = QwenVLM(model.train())
        compute = getattr(torch, job.model.dtype)  # frozen copies in the compute dtype, as the system's teacher and rollout engines
        self.teacher = QwenVLM(copy.deepcopy(model).to(compute).eval().requires_grad_(False))
        self.optimizer, self.scheduler = build_optimizer(model, job.optimizer)
        self.schedule = BudgetSchedule.from_config(job.budget)
        self.selector = build_selector(job.selector.name, job.selector.scope)
        self.params = sampling_params(job, self.processor)
        self.step_index = 0  # optimizer steps completed: the curriculum's c
        # max_staleness 1: the weights one optimizer step behind, which sample the rollouts
        self.lagged = QwenVLM(copy.deepcopy(model).to(compute).eval().requires_grad_(False)) if job.schedule.max_staleness else None
        judge = Judge(job.reward.judge, job.data, job.model.dtype, micro_batch_tokens=job.pools.reward.micro_batch_tokens) if job.reward.uses_judge else None  # in process
        self.reward = JobReward.of(job, judge)  # as the rollout workers give it

    def encode(self, samples: list[Sample]):
        return encode_samples(self.processor, samples, self.job.data.system_prompt)

    @staticmethod
    def policy_inputs(rollouts, on_policy: bool, scale: bool = True, leave_flat_out: bool = False) -> PolicyInputs:
        """The RL baselines' advantages, each prompt's rollouts as one group (sampled by the weights being updated, or
        by the lagged copy a version behind); `scale`: divided by each group's spread (objective.scale_advantages);
        `leave_flat_out`: a group whose rewards are all equal takes no part in the step (dynamic sampling)."""
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rollouts):
            groups.setdefault(r.prompt_index, []).append(i)
        advantages, trained = torch.zeros(len(rollouts)), torch.ones(len(rollouts))
        old_logp: list[torch.Tensor | None] = [None] * len(rollouts)
        for members in groups.values():
            inputs = group_policy_inputs([rollouts[i] for i in members], on_policy, scale, leave_flat_out)
            advantages[members], trained[members] = inputs.advantages, inputs.trained
            for i, old in zip(members, inputs.old_logp):
                old_logp[i] = old
        return PolicyInputs(advantages, old_logp, trained)

    def sample(self, samples: list[Sample], prompts: list, budget: int) -> list:
        """The rollouts of `samples` (encoded as `prompts`) in this update, rewarded where the job has a reward."""
        rollouts = rollout(
            self.student if self.lagged is None else self.lagged,
            self.processor.tokenizer,
            prompts,
            [s.uid for s in samples],
            self.selector,
            budget,
            self.job.budget.k_min,
            self.params,
            self.job.sampling.n,
            self.job.seed,
            self.step_index,
            behaviour=self.teacher if self.job.objective.prefixes == "teacher" else None,
            written=[s.response for s in samples] if self.job.objective.prefixes == "dataset" else None,
        )
        if self.reward is not None:
            rows = [samples[r.prompt_index] for r in rollouts]
            for r, value in zip(rollouts, self.reward(rows, response_texts(self.processor, rollouts), [r.response_ids.numel() for r in rollouts])):
                r.reward = value
        return rollouts

    def resample_flat(self, samples: list[Sample], prompts: list, rollouts: list, budget: int) -> tuple[list, int, int]:
        """Dynamic sampling as the driver runs it (core/dynamic_sampling.py), round by round: each slot's chain of
        reserved rows is its own, so the rows and groups are the driver's, which moves each slot on as its group
        finishes. `samples` and `prompts` get the new rows in place; returns the update's rollouts in prompt order, the
        groups replaced and those kept flat."""
        rounds, resampled = self.job.reward.dynamic_sampling_rounds, 0
        reserved = reserve_rows(self.rows, self.job.data.shuffle_seed, self.step_index, {s.uid for s in samples}, range(len(samples)), rounds)
        flat = [p for p in range(len(samples)) if is_flat([r.reward for r in rollouts if r.prompt_index == p])]
        for round_ in range(rounds):
            if not flat:
                break
            new = [reserved[slot][round_] for slot in flat]
            encoded = self.encode(new)
            again = self.sample(new, encoded, budget)
            for r in again:
                r.prompt_index = flat[r.prompt_index]
            for slot, row, prompt in zip(flat, new, encoded):
                samples[slot], prompts[slot] = row, prompt
            rollouts = sorted([r for r in rollouts if r.prompt_index not in flat] + again, key=lambda r: r.prompt_index)
            resampled += len(flat)
            flat = [slot for slot in flat if is_flat([r.reward for r in again if r.prompt_index == slot])]
        return rollouts, resampled, len(flat)

    def update(self, samples: list[Sample]) -> StepReport:
        c = self.step_index
        budget = self.schedule.budget_bps(c)
        samples = list(samples)
        prompts = self.encode(samples)
        dynamic = None
        with compute_precision(self.job.model.dtype, self.student.device):
            rollouts = self.sample(samples, prompts, budget)
            if self.job.reward.dynamic_sampling_rounds:
                rollouts, *dynamic = self.resample_flat(samples, prompts, rollouts, budget)
            scores = teacher_scores(
                self.teacher, prompts, rollouts, self.job.objective.top_k, self.job.objective.logsoftmax_chunk,
                self.job.pools.teacher.micro_batch_tokens, packed=self.job.pools.teacher.packing,
            ) if self.job.objective.teacher_scores else None  # the cross-entropy modes and the RL baselines ask no teacher
            on_policy = self.lagged is None or c == 0
            policy = (self.policy_inputs(rollouts, on_policy, self.job.objective.scale_advantages, self.job.reward.dynamic_sampling_rounds > 0)
                      if self.job.objective.policy_gradient else None)
        if self.lagged is not None:
            self.lagged.model.load_state_dict(self.student.model.state_dict())  # v(c) samples update c + 1
        steps = self.job.optimizer.steps_per_update
        batches = update_mini_batches(len(samples), self.job.pools.learner.ranks, steps)
        if policy is not None and steps > 1 and None in policy.old_logp:  # later steps compare with the weights the update starts from
            with torch.no_grad(), compute_precision(self.job.model.dtype, self.student.device):
                forward = student_forward(self.student, prompts, rollouts, self.job.pools.learner.packing)
                recorded = sampled_log_probs(self.student, forward, rollouts, self.job.objective.logsoftmax_chunk)
            first = set(batches[0])
            policy = with_old_log_probs(policy, [None if r.prompt_index in first else logp for r, logp in zip(rollouts, recorded)])
        parts, norms = [], []
        for batch in map(set, batches):
            chosen = [i for i, r in enumerate(rollouts) if r.prompt_index in batch]
            mine = [rollouts[i] for i in chosen]
            if policy is not None:  # the mini-batch's responses (or tokens) of the prompts that take part in the step
                normaliser = max(trained_count(self.job.objective, mine, policy.trained[chosen].tolist()), 1)
            else:
                normaliser = update_normaliser(self.job.objective, len(mine), sum(r.response_ids.numel() for r in mine))
            with compute_precision(self.job.model.dtype, self.student.device):
                loss, stats = student_loss(
                    self.student, prompts, mine, [scores[i] for i in chosen] if scores is not None else None, self.job.objective, normaliser,
                    policy.of(chosen) if policy is not None else None,
                    packed=self.job.pools.learner.packing,
                )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.student.model.parameters(), self.job.optimizer.grad_clip)))
            self.optimizer.step()
            self.scheduler.step()
            parts.append(stats)
        self.step_index += 1
        stats = LossStats.combine(parts)
        stats.loss /= steps  # the mean of the mini-batches' losses
        return StepReport(
            step=c,
            budget_bps=budget,
            stats=stats,
            grad_norm=sum(norms) / steps,
            mean_response_tokens=stats.tokens / len(rollouts),
            reward_mean=sum(r.reward for r in rollouts) / len(rollouts) if self.reward is not None else None,
            resampled_groups=dynamic[0] if dynamic else None,
            flat_groups=dynamic[1] if dynamic else None,
        )
