"""The three roles of one LT-OPD update (DESIGN §1), as plain functions on one process.

rollout -> teacher_scores -> student_loss. The single-process reference update
(`reference.py`) composes them directly; the distributed runtime runs each in its
own actor pool and must reproduce the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from .data import stable_seed
from .models.adapter import QwenVLM, ReducedPrompt
from .models.processor import PromptInputs
from .models.sampler import Completion, SamplingParams, sample
from .objective import gather_log_probs, lt_opd_token_losses, seq_mean_token_mean, top_k_log_probs, union_support
from .selectors import Selector


@dataclass
class Rollout:
    """One sampled response of the student at budget r; everything the learner replays."""

    prompt_index: int  # index into the update's prompt list
    response_ids: torch.Tensor  # [T] long
    old_logp: torch.Tensor  # [T] fp32, sampled token under the rollout policy
    student_top_ids: torch.Tensor  # [T, k] long
    selected: list[torch.Tensor]  # per image: kept visual-token indices (sorted)
    budget_bps: int
    finish_reason: str


@dataclass
class TeacherScore:
    """The frozen teacher's view of one rollout, on the full-token prompt."""

    top_ids: torch.Tensor  # [T, k] int32
    top_logp: torch.Tensor  # [T, k]
    requested_logp: torch.Tensor  # [T, k + 1]: at the student's top-k ids, then at the sampled token


@dataclass
class LossStats:
    loss: float
    divergence: float  # token-mean divergence
    importance_weight: float  # token-mean truncated importance weight
    top_k_overlap: float  # mean |student top-k ∩ teacher top-k| / k
    tokens: int


@torch.no_grad()
def rollout(
    vlm: QwenVLM,
    tokenizer,
    prompts: list[PromptInputs],
    uids: list[str],
    selector: Selector,
    budget_bps: int,
    k_min: int,
    params: SamplingParams,
    n: int,
    seed: int,
    step: int,
    behaviour: QwenVLM | None = None,
) -> list[Rollout]:
    """n responses per prompt at the current budget; selection and sampling are seeded by (seed, step, uid).

    With `behaviour` (the frozen teacher; the fixed-prefix and SFT ablations) the
    responses are sampled by it at full tokens, and the student's log-probs and
    top-k at budget r are read off its teacher-forced forward on them.
    """
    reduced, full, owners, seeds = [], [], [], []
    for index, (prompt, uid) in enumerate(zip(prompts, uids)):
        features = vlm.visual_features(prompt)
        selected = vlm.select(prompt, features, selector, budget_bps, k_min, seed=stable_seed(seed, step, uid))
        prompt_reduced = vlm.reduce(prompt, features, selected)
        prompt_full = None
        if behaviour is not None:
            behaviour_features = behaviour.visual_features(prompt)
            prompt_full = behaviour.reduce(prompt, behaviour_features, behaviour.keep_all(behaviour_features))
        for j in range(n):
            reduced.append(prompt_reduced)
            full.append(prompt_full)
            owners.append(index)
            seeds.append(stable_seed(seed, step, uid, j))
    if behaviour is None:
        completions = sample(vlm, reduced, params, seeds, tokenizer)
    else:
        completions = student_view(vlm, reduced, sample(behaviour, full, params, seeds, tokenizer), params.top_k_logprobs)
    return [
        Rollout(
            prompt_index=owner,
            response_ids=c.token_ids,
            old_logp=c.logprobs,
            student_top_ids=c.top_ids,
            selected=red.selected,
            budget_bps=budget_bps,
            finish_reason=c.finish_reason,
        )
        for owner, red, c in zip(owners, reduced, completions)
    ]


def student_view(vlm: QwenVLM, reduced: list[ReducedPrompt], completions: list[Completion], top_k: int) -> list[Completion]:
    """The same responses with the student's log-prob of each token and its top-k ids, on its reduced prompts."""
    hidden = vlm.response_hidden(reduced, [c.token_ids for c in completions])
    viewed = []
    for h, c in zip(hidden, completions):
        log_probs = torch.log_softmax(vlm.lm_head(h).float(), dim=-1).cpu()  # [T, V]
        viewed.append(
            Completion(
                token_ids=c.token_ids,
                logprobs=log_probs.gather(-1, c.token_ids[:, None]).squeeze(-1),
                top_ids=torch.topk(log_probs, min(top_k, log_probs.shape[-1]), dim=-1).indices,
                finish_reason=c.finish_reason,
            )
        )
    return viewed


@torch.no_grad()
def teacher_scores(
    teacher: QwenVLM, prompts: list[PromptInputs], rollouts: list[Rollout], top_k: int, chunk_size: int
) -> list[TeacherScore]:
    """Full-vocabulary log-softmax of the full-token teacher at every response position, compacted to top-k."""
    full_prompts = {}
    for r in rollouts:
        if r.prompt_index not in full_prompts:
            prompt = prompts[r.prompt_index]
            features = teacher.visual_features(prompt)
            full_prompts[r.prompt_index] = teacher.reduce(prompt, features, teacher.keep_all(features))
    hidden = teacher.response_hidden([full_prompts[r.prompt_index] for r in rollouts], [r.response_ids for r in rollouts])
    weight = teacher.lm_head.weight
    scores = []
    for h, r in zip(hidden, rollouts):
        requested = torch.cat([r.student_top_ids, r.response_ids[:, None]], dim=-1).to(h.device)
        ids, logp, requested_logp = top_k_log_probs(h, weight, min(top_k, weight.shape[0]), chunk_size, requested)
        scores.append(TeacherScore(top_ids=ids.to(torch.int32).cpu(), top_logp=logp.cpu(), requested_logp=requested_logp.cpu()))
    return scores


def support(rollout_: Rollout, score: TeacherScore) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U = student top-k ∪ teacher top-k ∪ {sampled}: ids [T, 2k+1], valid mask, teacher log-probs on U."""
    k = rollout_.student_top_ids.shape[1]
    ids, valid = union_support(rollout_.student_top_ids, score.top_ids.long(), rollout_.response_ids[:, None])
    req = score.requested_logp.float()
    teacher_logp = torch.cat([req[:, :k], score.top_logp.float(), req[:, k:]], dim=-1)
    return ids, valid, teacher_logp


def student_loss(
    student: QwenVLM,
    prompts: list[PromptInputs],
    rollouts: list[Rollout],
    scores: list[TeacherScore],
    objective,
) -> tuple[torch.Tensor, LossStats]:
    """Seq-mean-token-mean LT-OPD loss of the student on the replayed reduced inputs (differentiable)."""
    reduced = []
    for r in rollouts:
        prompt = prompts[r.prompt_index]
        features = student.visual_features(prompt)  # with gradients: vision encoder and merger are trained
        reduced.append(student.reduce(prompt, features, r.selected))  # replayed, never recomputed
    hidden = student.response_hidden(reduced, [r.response_ids for r in rollouts])
    token_losses, divs, weights, overlaps = [], [], [], []
    for h, r, s in zip(hidden, rollouts, scores):
        ids, valid, teacher_logp = (t.to(h.device) for t in support(r, s))
        student_logp = gather_log_probs(h, student.lm_head.weight, ids, objective.logsoftmax_chunk)
        token_loss, div, weight = lt_opd_token_losses(
            student_logp,
            teacher_logp,
            valid,
            sampled_column=ids.shape[1] - 1,
            old_logp=r.old_logp.to(h.device),
            kind=objective.divergence,
            alpha=objective.alpha,
            importance_clip=objective.importance_clip,
        )
        if objective.mode == "sft":
            token_loss = -student_logp[:, ids.shape[1] - 1]  # cross-entropy on the teacher's sampled token
        token_losses.append(token_loss)
        divs.append(div.detach())
        weights.append(weight)
        k = r.student_top_ids.shape[1]
        overlaps.append((k - valid[:, k : 2 * k].sum(-1)).float() / k)  # teacher top-k ids already in student top-k
    padded = pad_sequence(token_losses, batch_first=True)
    mask = pad_sequence([torch.ones_like(t) for t in token_losses], batch_first=True)
    loss = seq_mean_token_mean(padded, mask)
    stats = LossStats(
        loss=float(loss.detach()),
        divergence=float(torch.cat(divs).mean()),
        importance_weight=float(torch.cat(weights).mean()),
        top_k_overlap=float(torch.cat(overlaps).mean()),
        tokens=int(sum(r.response_ids.numel() for r in rollouts)),
    )
    return loss, stats
