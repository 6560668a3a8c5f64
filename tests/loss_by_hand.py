"""The LT-OPD loss written from the paper's formula, independently of models/loss.py and core/objective.py.

Plain transformers forwards (full vocabulary, fp64 log-softmax), the support built as a Python set, each bin's
probability a float, the tail bin 1 - Σ_U p, the divergence term by term and the importance weight as a Python
product: what the learner computes with tensors, columns and masks, computed here one token at a time.
"""

from __future__ import annotations

import math

import torch


def plain_log_probs(model, inputs_embeds=None, position_ids=None, prompt_length=0, response=None, **inputs) -> torch.Tensor:
    """Full-vocabulary log-softmax (fp64) at the positions predicting `response`, from one plain transformers forward."""
    with torch.no_grad():
        if inputs_embeds is not None:
            inputs = {"inputs_embeds": inputs_embeds[None], "position_ids": position_ids,
                      "attention_mask": torch.ones(1, inputs_embeds.shape[0], dtype=torch.long)}
        logits = model(**inputs).logits[0].double()
    return torch.log_softmax(logits[prompt_length - 1 : prompt_length - 1 + response.numel()], dim=-1)


def kl_by_hand(p: list[float], q: list[float]) -> float:
    """KL(P || Q) = Σ p log(p / q), bin by bin (0 log 0 = 0)."""
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def divergence_by_hand(student: list[float], teacher: list[float], kind: str, alpha: float) -> float:
    """jsd: (1 - α) KL(P_S || M) + α KL(P_T || M), M = (1 - α) P_S + α P_T; forward_kl: KL(P_T || P_S); reverse_kl:
    KL(P_S || P_T)."""
    if kind == "jsd":
        mixture = [(1 - alpha) * s + alpha * t for s, t in zip(student, teacher)]
        return (1 - alpha) * kl_by_hand(student, mixture) + alpha * kl_by_hand(teacher, mixture)
    if kind == "forward_kl":
        return kl_by_hand(teacher, student)
    if kind == "reverse_kl":
        return kl_by_hand(student, teacher)
    raise ValueError(kind)


def importance_by_hand(student_logp: list[float], old_logp: list[float], mode: str, clip: float) -> list[float]:
    """Per position t: min(exp(logp_t - old_t), clip) (`token`), or min(Π_{j<t} exp(logp_j - old_j), clip) (`prefix`, 1
    at t = 0)."""
    if mode == "token":
        return [min(math.exp(s - o), clip) for s, o in zip(student_logp, old_logp)]
    weights, product = [], 1.0
    for s, o in zip(student_logp, old_logp):
        weights.append(min(product, clip))
        product *= math.exp(s - o)
    return weights


def teacher_log_probs(trainer, prompt, rollout) -> torch.Tensor:
    """[T, V] fp64 log-probs of a rollout's response under the teacher's full-token forward (a plain transformers call)."""
    response = rollout.response_ids
    ids = torch.cat([prompt.input_ids, response])[None]
    return plain_log_probs(trainer.teacher.model, input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=prompt.pixel_values,
                           image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=torch.cat([prompt.mm_token_type_ids, torch.zeros_like(response)])[None],
                           prompt_length=prompt.input_ids.numel(), response=response)


def student_log_probs(trainer, prompt, rollout) -> torch.Tensor:
    """[T, V] fp64 log-probs of a rollout's response under the student's forward on the rollout's reduced prompt."""
    student, response = trainer.student, rollout.response_ids
    with torch.no_grad():
        reduced = student.reduce(prompt, student.visual_features(prompt), rollout.selected)
        embeds = torch.cat([reduced.inputs_embeds, student.embed_tokens(response)])
    rope = torch.cat([reduced.positions, (reduced.next_position + torch.arange(response.numel())).expand(3, -1)], dim=1)
    positions = torch.cat([torch.arange(embeds.shape[0])[None], rope])[:, None]
    return plain_log_probs(student.model, embeds, positions, reduced.length, response)


def loss_by_hand(trainer, prompts, rollouts, objective, held: dict | None = None) -> float:
    """The LT-OPD loss from scratch at the objective's settings: per token, the support U = student top-k ∪ teacher
    top-k ∪ {sampled} (k = objective.top_k) as a set, one tail bin holding the rest of each distribution, the
    divergence (objective.divergence, objective.alpha) bin by bin, times the importance weight (objective.importance,
    clipped at objective.importance_clip) against the rollout's own log-probs; a response cut at max_new_tokens counts
    0 under `truncated: mask`; mean over each sequence's tokens, then over sequences.

    `held`: what the learner's loss takes as data, not as a function of the student's weights, by rollout, filled on
    first use and read after: the teacher's log-probs, the supports (the student's top-k at sampling) and the
    importance weights (detached). The loss at moved weights with `held` filled at the start then has the learner's
    gradient as its slope."""
    held = {} if held is None else held
    per_sequence = []
    for i, r in enumerate(rollouts):
        s = student_log_probs(trainer, prompts[r.prompt_index], r)
        if i not in held:
            t = teacher_log_probs(trainer, prompts[r.prompt_index], r)
            response = r.response_ids.tolist()
            supports = [sorted(set(torch.topk(s[j], objective.top_k).indices.tolist()) | set(torch.topk(t[j], objective.top_k).indices.tolist()) | {token})
                        for j, token in enumerate(response)]
            sampled = [float(s[j, token]) for j, token in enumerate(response)]
            held[i] = (t, supports, importance_by_hand(sampled, r.old_logp.tolist(), objective.importance, objective.importance_clip))
        t, supports, weights = held[i]
        losses = []
        for j, union in enumerate(supports):
            p_s = [math.exp(s[j, v]) for v in union]
            p_t = [math.exp(t[j, v]) for v in union]
            losses.append(weights[j] * divergence_by_hand([*p_s, 1 - sum(p_s)], [*p_t, 1 - sum(p_t)], objective.divergence, objective.alpha))
        masked = objective.truncated == "mask" and r.finish_reason == "length"
        per_sequence.append(0.0 if masked else sum(losses) / len(losses))
    return sum(per_sequence) / len(per_sequence)
