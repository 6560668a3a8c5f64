"""The learner role of an update (docs/architecture.md §1, steps 3-5): the student's loss on replayed rollouts."""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from lt_opd_ray.core.dynamic_sampling import is_flat
from lt_opd_ray.core.objective import divergence, gather_log_probs, lt_opd_token_losses, union_support
from lt_opd_ray.core.rl import LOG_RATIO_LIMIT, SEQUENCE_LOG_RATIO_LIMIT, TOKEN_MEAN, group_advantages, sequence_terms
from lt_opd_ray.core.wire import Rollout, TeacherScore
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.processor import TEXT, PromptInputs
from lt_opd_ray.models.transfer import to_device


Figure = float | torch.Tensor  # a statistic: a 0-dim detached tensor on the device until `LossStats.on_host` reads it


@dataclass
class LossStats:
    """A micro-batch's (or an update's) statistics. The losses leave their figures on the device, where they were
    computed: a step combines its micro-batches' there and reads them once (`on_host`), not ~10 device syncs each."""

    loss: Figure
    divergence: Figure | None  # token-mean divergence; None (and top_k_overlap) where the job has no teacher
    importance_weight: Figure  # token-mean truncated importance weight (the RL baselines: their ratio)
    top_k_overlap: Figure | None  # mean |student top-k ∩ teacher top-k| / k
    tokens: int
    sequences: int = 0
    vision_forwards: int = 0  # vision tower + merger passes: one per prompt when its group fits one micro-batch
    clipped: Figure = 0.0  # token-mean share of importance weights cut to objective.importance_clip (RL baselines: tokens the clip stops)
    logprob_gap: Figure = 0.0  # token-mean |learner's - rollout engine's log-prob| of the sampled token
    truncated: int = 0  # responses cut at sampling.max_new_tokens
    longest: int = 0  # tokens of the longest response

    FIGURES = ("loss", "divergence", "importance_weight", "top_k_overlap", "clipped", "logprob_gap")

    def on_host(self) -> LossStats:
        """These statistics with every figure a float: the tensors among them read in one transfer."""
        held = [name for name in self.FIGURES if isinstance(getattr(self, name), torch.Tensor)]
        if not held:
            return self
        values = torch.stack([getattr(self, name).detach().float().reshape(()) for name in held]).tolist()
        return dataclasses.replace(self, **dict(zip(held, values)))

    @staticmethod
    def combine(parts: list[LossStats]) -> LossStats:
        """Stats of consecutive micro-batches of one update: losses add (each is already normalised by the
        update's sequence count), token means are re-weighted by tokens. Figures stay where they are."""
        tokens = sum(p.tokens for p in parts)

        def weighted(key: str) -> Figure | None:
            if any(getattr(p, key) is None for p in parts):  # no teacher: nothing to compare with
                return None
            return sum(getattr(p, key) * p.tokens for p in parts) / max(tokens, 1)

        return LossStats(
            loss=sum(p.loss for p in parts),
            divergence=weighted("divergence"),
            importance_weight=weighted("importance_weight"),
            top_k_overlap=weighted("top_k_overlap"),
            tokens=tokens,
            sequences=sum(p.sequences for p in parts),
            vision_forwards=sum(p.vision_forwards for p in parts),
            clipped=weighted("clipped"),
            logprob_gap=weighted("logprob_gap"),
            truncated=sum(p.truncated for p in parts),
            longest=max((p.longest for p in parts), default=0),
        )


def supports_of(rollouts: list[Rollout], scores: list[TeacherScore], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per rollout, U = student top-k ∪ teacher top-k ∪ {sampled}: ids [T, 2k+1], valid mask, teacher log-probs on U.
    Built on `device` for every response row of the micro-batch at once: the top-k ids travel there (int32) and one
    sort marks the repeats, rather than a sort per rollout on the host and its [T, 2k+1] result copied over."""
    def on_device(tensors):
        return to_device(torch.cat(tensors), device)

    k = rollouts[0].student_top_ids.shape[1]
    ids, valid = union_support(on_device([r.student_top_ids for r in rollouts]).long(), on_device([s.top_ids for s in scores]).long(),
                               on_device([r.response_ids for r in rollouts])[:, None])
    requested = on_device([s.requested_logp for s in scores]).float()
    teacher_logp = torch.cat([requested[:, :k], on_device([s.top_logp for s in scores]).float(), requested[:, k:]], dim=-1)
    lengths = [r.response_ids.numel() for r in rollouts]
    return list(zip(ids.split(lengths), valid.split(lengths), teacher_logp.split(lengths)))


def reduced_length(prompt: PromptInputs, selected: list[torch.Tensor]) -> int:
    """Tokens of the reduced prompt: the full prompt less the visual tokens that were not kept."""
    image_tokens = int((prompt.mm_token_type_ids != TEXT).sum())
    return prompt.input_ids.numel() - image_tokens + sum(int(s.numel()) for s in selected)


@dataclass(frozen=True)
class StudentForward:
    """The student's differentiable forward on replayed rollouts, before the output head: what the loss needs
    besides the teacher's scores, so a learner can compute it while the teacher is still scoring."""

    hidden: list[torch.Tensor]  # per rollout: [T, H] hidden states at the rows that predict its response tokens
    vision_forwards: int  # vision tower + merger passes (one per prompt)
    positions: int = 0  # what the language model's forward computed: rows x width of its batch (packed: the tokens)


def student_forward(student: QwenVLM, prompts: Mapping[int, PromptInputs] | list[PromptInputs], rollouts: list[Rollout],
                    packed: bool = False) -> StudentForward:
    """The student's reduced prompts (each rollout's selection and merge routes replayed, never recomputed) and its
    hidden states at the response rows, from left-padded rows or one packed row (`packed`). The vision tower runs
    once per prompt: the n rollouts of a prompt replay their selections on the same features, and autograd sums
    their gradients."""
    features = {}
    reduced = []
    for r in rollouts:
        prompt = prompts[r.prompt_index]
        if r.prompt_index not in features:
            features[r.prompt_index] = student.visual_features(prompt)  # with gradients: vision encoder and merger are trained
        reduced.append(student.reduce(prompt, features[r.prompt_index], r.selected, r.merge_routes))  # replayed, never recomputed
    hidden, positions = student.teacher_forced(reduced, [r.response_ids for r in rollouts], packed)
    return StudentForward(hidden, len(features), positions)


@dataclass(frozen=True)
class PolicyInputs:
    """What an RL baseline's loss reads besides the student's log-probs, per rollout of a micro-batch."""

    advantages: torch.Tensor  # [B] each rollout's reward relative to its prompt's group (`core.rl.group_advantages`)
    old_logp: list[torch.Tensor | None]  # per rollout, the old policy's log-probs of its tokens ([T]); None: the weights trained now
    trained: torch.Tensor  # [B] 1 where the rollout takes part in the step, 0 where its group is left out (`group_policy_inputs`)

    def of(self, members: list[int]) -> PolicyInputs:
        """These rollouts' inputs, in this order."""
        return PolicyInputs(self.advantages[members], [self.old_logp[i] for i in members], self.trained[members])


def group_policy_inputs(rollouts: list[Rollout], on_policy: bool, scale: bool = True, leave_flat_out: bool = False) -> PolicyInputs:
    """`PolicyInputs` of one prompt's rollouts (its whole group of sampling.n responses, rewarded). The old policy:
    for rollouts sampled by the weights this update starts from, those weights (None here: the student's own
    log-probs at the update's first step, or `with_old_log_probs` recorded before it); for rollouts sampled a version
    earlier (schedule.max_staleness 1), the rollout engine's recorded log-probs, the only record of that policy.
    `scale`: the advantages divided by the group's spread (objective.scale_advantages). `leave_flat_out` (dynamic
    sampling): a group whose rewards are all equal takes no part in the step (DAPO's filter): no loss, no place in the
    normaliser (`trained_count`)."""
    rewards = [r.reward for r in rollouts]
    advantages = group_advantages(torch.tensor(rewards), len(rollouts), scale=scale)
    trained = torch.full((len(rollouts),), 0.0 if leave_flat_out and is_flat(rewards) else 1.0)
    return PolicyInputs(advantages, [None if on_policy else r.old_logp for r in rollouts], trained)


def with_old_log_probs(policy: PolicyInputs, recorded: list[torch.Tensor | None]) -> PolicyInputs:
    """`policy` with the log-probs the update's starting weights gave (`sampled_log_probs`, before its first optimizer
    step) as the old policy where it was None: what a later step of the update compares with."""
    return PolicyInputs(policy.advantages, [old if old is not None else new for old, new in zip(policy.old_logp, recorded)], policy.trained)


def trained_count(objective, rollouts: list[Rollout], trained: list[float]) -> int:
    """What the step's loss divides these rollouts by, counting those that take part: their responses, or their
    response tokens (`averages_tokens`)."""
    chosen = [r for r, keep in zip(rollouts, trained) if keep]
    return update_normaliser(objective, len(chosen), sum(r.response_ids.numel() for r in chosen))


@torch.no_grad()
def sampled_log_probs(student: QwenVLM, forward: StudentForward, rollouts: list[Rollout], chunk: int) -> list[torch.Tensor]:
    """The student's log-probs of each rollout's own tokens ([T] each), without gradients: the old policy an update's
    later optimizer steps compare with (`optimizer.steps_per_update`), taken before its first step."""
    ids = torch.cat([r.response_ids for r in rollouts])[:, None].to(forward.hidden[0].device)
    logp = gather_log_probs(torch.cat(forward.hidden), student.lm_head.weight, ids, chunk)[:, 0]
    return list(logp.float().cpu().split([h.shape[0] for h in forward.hidden]))


def averages_tokens(objective) -> bool:
    """The update's loss is a mean over its response tokens (DAPO's), not over its responses."""
    return objective.policy_gradient and objective.mode in TOKEN_MEAN


def update_normaliser(objective, sequences: int, tokens: int) -> float:
    """What an update's summed per-response losses divide by: its responses, or its response tokens (`averages_tokens`)."""
    return tokens if averages_tokens(objective) else sequences


def student_loss(
    student: QwenVLM,
    prompts: Mapping[int, PromptInputs] | list[PromptInputs],
    rollouts: list[Rollout],
    scores: list[TeacherScore] | None,
    objective,
    normaliser: float | None = None,
    policy: PolicyInputs | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, LossStats]:
    """Σ over these rollouts of each one's token-mean loss, / `normaliser` (differentiable); `packed`: the student's
    forward on one packed row (`student_forward`).

    With the default normaliser (the number of rollouts) this is the seq-mean-token-mean of
    the batch. A micro-batch of an update passes the update's sequence count instead, so
    the micro-batch losses add up to the update's seq-mean-token-mean, not to a mean of
    micro-batch means. `scores` is None where the objective reads no teacher (the cross-entropy modes, the RL
    baselines); `policy` is what an RL baseline reads (`update_normaliser`: its normaliser).
    """
    loss, stats = loss_on_forward(student, student_forward(student, prompts, rollouts, packed), rollouts, scores, objective, normaliser, policy)
    return loss, stats.on_host()


def loss_on_forward(
    student: QwenVLM, forward: StudentForward, rollouts: list[Rollout], scores: list[TeacherScore] | None, objective,
    normaliser: float | None = None, policy: PolicyInputs | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """`student_loss` from the student's forward on `rollouts` (`student_forward`) and the teacher's scores, or, where
    the objective reads none (`scores` None), the cross-entropy of the responses' own tokens: their log-probs alone
    are computed, and the statistics that compare with the teacher (divergence, top-k overlap) are None."""
    if (scores is not None) != objective.teacher_scores:
        raise ValueError(f"objective.mode {objective.mode} {'reads' if objective.teacher_scores else 'reads no'} teacher scores, but"
                         f" {'none were' if scores is None else 'some were'} given")
    normaliser = normaliser or update_normaliser(objective, len(rollouts), sum(r.response_ids.numel() for r in rollouts))
    hidden = forward.hidden
    device = hidden[0].device
    sampled_only = scores is None
    if sampled_only:  # one column per position: the response's own token
        supports = [(to_device(r.response_ids[:, None], device), None, None) for r in rollouts]
    else:
        supports = supports_of(rollouts, scores, device)
    # one output-head pass over every response row of the micro-batch (one [V, H] gradient buffer, not one per sequence)
    lengths = [h.shape[0] for h in hidden]
    ids_all = torch.cat([ids for ids, _, _ in supports])
    student_logp_all = gather_log_probs(torch.cat(hidden), student.lm_head.weight, ids_all, objective.logsoftmax_chunk)
    if objective.policy_gradient:  # the sampled token's column is the last of each support
        per_rollout = student_logp_all.split(lengths)
        sampled = tuple(lp[:, ids.shape[1] - 1 :] for lp, (ids, _, _) in zip(per_rollout, supports))
        reference = None if sampled_only else [(lp, valid, teacher_logp) for lp, (_, valid, teacher_logp) in zip(per_rollout, supports)]
        return policy_gradient_loss(sampled, rollouts, forward, objective, normaliser, policy, reference)
    sequence_losses, divs, weights, overlaps, gaps = [], [], [], [], []
    for student_logp, r, (ids, valid, teacher_logp) in zip(student_logp_all.split(lengths), rollouts, supports):
        old_logp = to_device(r.old_logp, device)
        sampled_logp = student_logp[:, ids.shape[1] - 1]  # the sampled token's column (the last of the support)
        if sampled_only:
            token_loss = -sampled_logp  # cross-entropy of the response's own token (sft, sequence_kd)
            weight = torch.exp(sampled_logp.detach() - old_logp).clamp(max=objective.importance_clip)  # a health figure only
        else:
            token_loss, div, weight = lt_opd_token_losses(
                student_logp,
                teacher_logp,
                valid,
                sampled_column=ids.shape[1] - 1,
                old_logp=old_logp,
                kind=objective.divergence,
                alpha=objective.alpha,
                importance_clip=objective.importance_clip,
                importance=objective.importance,
            )
            k = r.student_top_ids.shape[1]
            divs.append(div.detach())
            overlaps.append((k - valid[:, k : 2 * k].sum(-1)).float() / k)  # teacher top-k ids already in student top-k
        if token_loss.numel() == 0:
            raise ValueError(f"a rollout of prompt {r.prompt_index} has no response tokens: nothing to average")
        if objective.truncated == "mask" and r.finish_reason == "length":
            token_loss = token_loss * 0.0  # cut at max_new_tokens: no loss (the same graph, no gradient)
        sequence_losses.append(token_loss.mean())  # mean over the sequence's tokens
        weights.append(weight)
        gaps.append((sampled_logp.detach() - old_logp).abs())  # the engines' mismatch on the sampled token
    loss = torch.stack(sequence_losses).sum() / normaliser  # then mean over the update's sequences
    stats = LossStats(
        loss=loss.detach(),
        divergence=torch.cat(divs).mean() if divs else None,
        importance_weight=torch.cat(weights).mean(),
        top_k_overlap=torch.cat(overlaps).mean() if overlaps else None,
        tokens=sum(r.response_ids.numel() for r in rollouts),
        sequences=len(rollouts),
        vision_forwards=forward.vision_forwards,
        clipped=(torch.cat(weights) >= objective.importance_clip).float().mean(),
        logprob_gap=torch.cat(gaps).mean(),
        truncated=sum(r.finish_reason == "length" for r in rollouts),
        longest=max(r.response_ids.numel() for r in rollouts),
    )
    return loss, stats


def policy_gradient_loss(sampled_logp: tuple[torch.Tensor, ...], rollouts: list[Rollout], forward: StudentForward, objective,
                         normaliser: float, policy: PolicyInputs | None, reference: list[tuple] | None = None) -> tuple[torch.Tensor, LossStats]:
    """An RL baseline's loss (`core.rl.sequence_terms`, summed, / `normaliser`) on the student's log-probs of the
    sampled tokens ([T, 1] per rollout). The old policy (`policy.old_logp`): where None, the student's own
    log-probs, detached (the update's first step on rollouts of its starting weights: exactly the sampling policy,
    free of the rollout engine's rounding, so every ratio is 1); else the given log-probs (the starting weights',
    recorded before the first step, for a later step; the rollout engine's for rollouts sampled a version earlier),
    whose ratios the clip bounds. `reference` (objective.kl_coef > 0): per rollout, the student's and the frozen
    weights' log-probs on the top-k union and its mask ([T, K] each), whose reverse KL per token, times kl_coef, joins
    each response's term, averaged as it is; without it the statistics that compare with a teacher are None."""
    if policy is None:
        raise ValueError(f"objective.mode {objective.mode} needs each rollout's advantage: none was given")
    if empty := [i for i, lp in enumerate(sampled_logp) if lp.shape[0] == 0]:
        raise ValueError(f"rollout(s) {empty} of the micro-batch have no response tokens: nothing to average")
    device = sampled_logp[0].device
    logp = pad_sequence([lp[:, 0] for lp in sampled_logp], batch_first=True)  # [B, T]
    recorded = pad_sequence([to_device(r.old_logp, device) for r in rollouts], batch_first=True)  # the rollout engine's
    old = pad_sequence([lp[:, 0].detach() if given is None else to_device(given, device, lp.dtype) for lp, given in zip(sampled_logp, policy.old_logp)],
                       batch_first=True)
    mask = pad_sequence([torch.ones(lp.shape[0], device=device) for lp in sampled_logp], batch_first=True)
    low, high = objective.clip_range
    terms = sequence_terms(logp, old, to_device(policy.advantages, device), mask, kind=objective.mode, clip_low=low, clip_high=high,
                           dual_clip=objective.dual_clip)
    kl = overlap = None
    if reference is not None:
        kl = pad_sequence([divergence(lp, teacher_lp, valid, "reverse_kl") for lp, valid, teacher_lp in reference], batch_first=True)  # [B, T]
        per_response = (kl * mask).sum(dim=1)  # DAPO: a sum, the update's tokens its normaliser; else each response's token mean
        terms = terms + objective.kl_coef * (per_response if objective.mode in TOKEN_MEAN else per_response / mask.sum(dim=1))
        k = rollouts[0].student_top_ids.shape[1]
        overlap = torch.cat([(k - valid[:, k : 2 * k].sum(-1)).float() / k for _, valid, _ in reference])  # teacher top-k ids already in student top-k
    if objective.truncated == "mask":
        terms = terms * to_device(torch.tensor([r.finish_reason != "length" for r in rollouts]), device, terms.dtype)  # no gradient
    terms = terms * to_device(policy.trained, device, terms.dtype)  # a group left out of the step: no loss (its KL term included)
    loss = terms.sum() / normaliser
    with torch.no_grad():  # token means as masked sums: no boolean indexing, nothing read back to the host
        tokens = sum(lp.shape[0] for lp in sampled_logp)

        def token_mean(values: torch.Tensor) -> torch.Tensor:
            return (values * mask).sum() / tokens

        log_ratio = (logp - old) * mask
        if objective.mode == "gspo":  # one ratio per response, shown at each of its tokens, bounded as the loss bounds it
            log_ratio = (log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True)).clamp(max=SEQUENCE_LOG_RATIO_LIMIT).expand_as(mask)
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        advantage = to_device(policy.advantages, device)[:, None]
        # the clip acts (no gradient through the token) where the ratio passed it in the advantage's direction
        clipped = ((ratio > 1 + high) & (advantage > 0)) | ((ratio < 1 - low) & (advantage < 0))
        if objective.dual_clip is not None and objective.mode != "gspo":  # and where the dual clip capped a push down
            clipped |= (ratio > objective.dual_clip) & (advantage < 0)
        gaps = (logp.detach() - recorded).abs().masked_fill(mask == 0, 0.0)  # the engines' mismatch on the sampled token
    stats = LossStats(
        loss=loss.detach(),
        divergence=token_mean(kl.detach()) if kl is not None else None,
        importance_weight=token_mean(ratio),
        top_k_overlap=overlap.mean() if overlap is not None else None,
        tokens=tokens,
        sequences=len(rollouts),
        vision_forwards=forward.vision_forwards,
        clipped=token_mean(clipped.float()),
        logprob_gap=token_mean(gaps),
        truncated=sum(r.finish_reason == "length" for r in rollouts),
        longest=max(r.response_ids.numel() for r in rollouts),
    )
    return loss, stats
