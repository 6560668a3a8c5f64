"""The three roles of one LT-OPD update (docs/architecture.md §1), as plain functions on one process.

rollout -> teacher_scores -> student_loss. The single-process reference update
(`reference.py`) composes them directly; the distributed runtime runs each in its
own actor pool and must reproduce the reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .data import stable_seed
from .microbatch import Sequence, pack
from .models.adapter import QwenVLM, ReducedPrompt
from .models.processor import IMAGE, PromptInputs
from .models.sampler import Completion, SamplingParams, sample
from .objective import gather_log_probs, lt_opd_token_losses, top_k_log_probs, union_support
from .selectors import Selector
from .wire import Rollout, TeacherScore


@dataclass
class LossStats:
    loss: float
    divergence: float  # token-mean divergence
    importance_weight: float  # token-mean truncated importance weight
    top_k_overlap: float  # mean |student top-k ∩ teacher top-k| / k
    tokens: int
    sequences: int = 0
    vision_forwards: int = 0  # vision tower + merger passes: one per prompt when its group fits one micro-batch

    @staticmethod
    def combine(parts: list[LossStats]) -> LossStats:
        """Stats of consecutive micro-batches of one update: losses add (each is already normalised by the
        update's sequence count), token means are re-weighted by tokens."""
        tokens = sum(p.tokens for p in parts)
        weighted = lambda key: sum(getattr(p, key) * p.tokens for p in parts) / max(tokens, 1)  # noqa: E731
        return LossStats(
            loss=sum(p.loss for p in parts),
            divergence=weighted("divergence"),
            importance_weight=weighted("importance_weight"),
            top_k_overlap=weighted("top_k_overlap"),
            tokens=tokens,
            sequences=sum(p.sequences for p in parts),
            vision_forwards=sum(p.vision_forwards for p in parts),
        )


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
    teacher: QwenVLM,
    prompts: Mapping[int, PromptInputs] | list[PromptInputs],
    rollouts: list[Rollout],
    top_k: int,
    chunk_size: int,
    token_budget: int = 16384,
) -> list[TeacherScore]:
    """Full-vocabulary log-softmax of the full-token teacher at every response position, compacted to top-k.

    Each prompt's full-token prefix (vision tower, merger and language model) runs once, alone;
    its cache (attention KV and Gated DeltaNet state) is shared by the prompt's responses, which
    continue from it in micro-batches of at most `token_budget` response tokens. Log-probs are
    computed at response positions only. A prompt's scores depend on its own rollouts only, never
    on which other prompts share the call, so the teacher service may batch groups as they arrive
    and the update stays deterministic (a long prefix fills a forward on its own).
    """
    weight = teacher.lm_head.weight
    k = min(top_k, weight.shape[0])
    scores: list[TeacherScore | None] = [None] * len(rollouts)
    by_prompt: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        by_prompt.setdefault(r.prompt_index, []).append(i)
    for prompt_index, indices in by_prompt.items():
        features = teacher.visual_features(prompts[prompt_index])
        full = teacher.reduce(prompts[prompt_index], features, teacher.keep_all(features))
        batch = teacher.pad_batch([full])
        prefix_hidden, cache = teacher.run_language_model(batch, use_cache=True)
        first = prefix_hidden[0, -1:]  # the prompt's last position predicts response token 0
        sequences = [Sequence(i, prompt_index, rollouts[i].response_ids.numel()) for i in indices]
        for micro in pack(sequences, token_budget):
            responses = [rollouts[i] for i in micro.sequences]
            hidden = teacher.continue_hidden(full, cache, 0, batch.attention_mask[0], [r.response_ids for r in responses])
            for i, r, h in zip(micro.sequences, responses, hidden):
                predicting = torch.cat([first, h[:-1]])  # response token j is predicted at position j - 1
                requested = torch.cat([r.student_top_ids, r.response_ids[:, None]], dim=-1).to(h.device)
                ids, logp, requested_logp = top_k_log_probs(predicting, weight, k, chunk_size, requested)
                scores[i] = TeacherScore(top_ids=ids.to(torch.int32).cpu(), top_logp=logp.cpu(), requested_logp=requested_logp.cpu())
    return scores


def support(rollout_: Rollout, score: TeacherScore) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U = student top-k ∪ teacher top-k ∪ {sampled}: ids [T, 2k+1], valid mask, teacher log-probs on U."""
    k = rollout_.student_top_ids.shape[1]
    ids, valid = union_support(rollout_.student_top_ids, score.top_ids.long(), rollout_.response_ids[:, None])
    req = score.requested_logp.float()
    teacher_logp = torch.cat([req[:, :k], score.top_logp.float(), req[:, k:]], dim=-1)
    return ids, valid, teacher_logp


def reduced_length(prompt: PromptInputs, selected: list[torch.Tensor]) -> int:
    """Tokens of the reduced prompt: the full prompt less the image tokens that were not kept."""
    image_tokens = int((prompt.mm_token_type_ids == IMAGE).sum())
    return prompt.input_ids.numel() - image_tokens + sum(int(s.numel()) for s in selected)


def student_loss(
    student: QwenVLM,
    prompts: Mapping[int, PromptInputs] | list[PromptInputs],
    rollouts: list[Rollout],
    scores: list[TeacherScore],
    objective,
    normaliser: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Σ over these rollouts of each one's token-mean LT-OPD loss, / `normaliser` (differentiable).

    With the default normaliser (the number of rollouts) this is the seq-mean-token-mean of
    the batch. A micro-batch of an update passes the update's sequence count instead, so
    the micro-batch losses add up to the update's seq-mean-token-mean, not to a mean of
    micro-batch means. The vision tower runs once per prompt: the n rollouts of a prompt
    replay their selections on the same features, and autograd sums their gradients.
    """
    normaliser = normaliser or len(rollouts)
    features = {}
    reduced = []
    for r in rollouts:
        prompt = prompts[r.prompt_index]
        if r.prompt_index not in features:
            features[r.prompt_index] = student.visual_features(prompt)  # with gradients: vision encoder and merger are trained
        reduced.append(student.reduce(prompt, features[r.prompt_index], r.selected))  # replayed, never recomputed
    hidden = student.response_hidden(reduced, [r.response_ids for r in rollouts])
    sequence_losses, divs, weights, overlaps = [], [], [], []
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
        if token_loss.numel() == 0:
            raise ValueError(f"a rollout of prompt {r.prompt_index} has no response tokens: nothing to average")
        sequence_losses.append(token_loss.mean())  # mean over the sequence's tokens
        divs.append(div.detach())
        weights.append(weight)
        k = r.student_top_ids.shape[1]
        overlaps.append((k - valid[:, k : 2 * k].sum(-1)).float() / k)  # teacher top-k ids already in student top-k
    loss = torch.stack(sequence_losses).sum() / normaliser  # then mean over the update's sequences
    stats = LossStats(
        loss=float(loss.detach()),
        divergence=float(torch.cat(divs).mean()),
        importance_weight=float(torch.cat(weights).mean()),
        top_k_overlap=float(torch.cat(overlaps).mean()),
        tokens=int(sum(r.response_ids.numel() for r in rollouts)),
        sequences=len(rollouts),
        vision_forwards=len(features),
    )
    return loss, stats
