"""The LT-OPD objective (docs/architecture.md §1, steps 3-5), pure torch.

Per response position, both distributions are evaluated on the support
U = student top-k ∪ teacher top-k ∪ {sampled token} plus one tail bin holding the
leftover mass; the divergence is weighted by a detached truncated importance
weight and aggregated as mean over tokens, then mean over sequences.

Full-vocabulary log-probs come from a chunked log-softmax over positions whose
backward recomputes each chunk's logits, so at most about chunk x V fp32 logits
exist at once, never [B, T, V].
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

Divergence = Literal["jsd", "forward_kl", "reverse_kl"]
TAIL_CLAMP = -1e-7  # logsumexp(lp_U) is clamped below 0 so the tail log-mass stays finite


class _ChunkedGatherLogProbs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T).gather(ids), one chunk of positions at a time, forward and backward.

    Saves only hidden, ids and the per-position logsumexp; backward recomputes each
    chunk's logits and turns them in place into the gradient, so one chunk x V fp32
    buffer is alive at a time. The output head's gradient is accumulated chunk by
    chunk into one [V, H] buffer in the weight's own dtype (the GEMM accumulates in
    fp32 inside; TF32 on GPU where the caller allows it): no fp32 [V, H] copy.
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, chunk_size):
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = F.linear(hidden[rows], weight).float()  # [C, V], only this chunk
            lse[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(-1, ids[rows]) - lse[rows, None]
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, ids, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            grad_logits = F.linear(hidden[rows], weight).float()
            grad_logits.sub_(lse[rows, None]).exp_()  # softmax p, in place
            # d lp[p, j] / d logit[p, v] = [v == ids[p, j]] - p[v]  =>  g = scatter(grad) - p * Σ_j grad[p, j]
            grad_logits.mul_(-grad_out[rows].sum(-1, keepdim=True))
            grad_logits.scatter_add_(-1, ids[rows], grad_out[rows].float())
            grad_logits = grad_logits.to(weight.dtype)  # [C, V] in the compute dtype for both GEMMs
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, hidden[rows].to(weight.dtype))  # dW += gᵀ h, in place
        return grad_hidden, grad_weight, None, None


def gather_log_probs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[p, ids[p]] for hidden [P, H], ids [P, K] -> [P, K] fp32, differentiable."""
    if hidden.shape[0] != ids.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} positions but ids has {ids.shape[0]}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedGatherLogProbs.apply(hidden, weight, ids, chunk_size)


@torch.no_grad()
def top_k_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, k: int, chunk_size: int, requested_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Top-k ids and log-probs of the full-vocabulary log-softmax per position, plus log-probs at requested ids.
    log p = logit - logsumexp(logits): the row's constant shifts nothing's rank, so the top k are taken from the logits
    and only the k + requested entries are shifted: no log-probs tensor of [chunk, V] to write and read beside the
    logits (benchmarks/bench_teacher_topk.py), the same values, ties of rounded log-probs ranked by their logits."""
    top_ids, top_lp, requested_lp = [], [], []
    for start in range(0, hidden.shape[0], chunk_size):
        logits = F.linear(hidden[start : start + chunk_size], weight).float()
        log_normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
        values, ids = torch.topk(logits, k, dim=-1)  # sorted, highest first
        top_ids.append(ids)
        top_lp.append(values - log_normaliser)
        if requested_ids is not None:
            requested_lp.append(logits.gather(-1, requested_ids[start : start + chunk_size]) - log_normaliser)
    return torch.cat(top_ids), torch.cat(top_lp), (torch.cat(requested_lp) if requested_ids is not None else None)


def union_support(*id_sets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate id sets [P, K_i] into U [P, ΣK_i] and mark the first occurrence of each id as valid.

    Duplicates stay in place (so the columns line up with the requested-id log-probs)
    but are masked out, so no id is counted twice.
    """
    ids = torch.cat(id_sets, dim=-1)
    sorted_ids, order = torch.sort(ids, dim=-1, stable=True)
    repeat = torch.zeros_like(sorted_ids, dtype=torch.bool)
    repeat[:, 1:] = sorted_ids[:, 1:] == sorted_ids[:, :-1]  # stable sort: the first occurrence stays unmarked
    valid = torch.empty_like(repeat).scatter_(-1, order, ~repeat)
    return ids, valid


def with_tail_bin(log_probs: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the tail bin log(1 - Σ_U p) = log(-expm1(min(logsumexp(lp_U), -1e-7))) -> [P, K+1]."""
    log_probs = log_probs.to(torch.promote_types(log_probs.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    masked = log_probs.masked_fill(~valid, -torch.inf)
    mass_u = torch.logsumexp(masked, dim=-1).clamp(max=TAIL_CLAMP)
    tail = torch.log(-torch.expm1(mass_u))
    full_valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=-1)
    # masked columns carry a finite placeholder (0) so no inf - inf reaches autograd; their probability is 0
    safe = torch.cat([log_probs.masked_fill(~valid, 0.0), tail[:, None]], dim=-1)
    return safe, full_valid


def _expectation(log_p: torch.Tensor, valid: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Σ_i p_i * value_i over the valid bins."""
    return torch.where(valid, log_p.exp() * value, torch.zeros_like(value)).sum(-1)


def divergence(
    student_lp: torch.Tensor,
    teacher_lp: torch.Tensor,
    valid: torch.Tensor,
    kind: Divergence = "jsd",
    alpha: float = 0.5,
) -> torch.Tensor:
    """Per-position divergence on U ∪ {tail}; student_lp/teacher_lp/valid are [P, K]. Gradients reach only the student."""
    s, full_valid = with_tail_bin(student_lp, valid)
    t, _ = with_tail_bin(teacher_lp.detach(), valid)
    if kind == "jsd":
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"JSD alpha must lie in (0, 1), got {alpha}")
        # M = (1-α) P_S + α P_T, in log space
        log_m = torch.logaddexp(s + math.log(1.0 - alpha), t + math.log(alpha))
        # (1-α) KL(P_S || M) + α KL(P_T || M)
        return (1.0 - alpha) * _expectation(s, full_valid, s - log_m) + alpha * _expectation(t, full_valid, t - log_m)
    if kind == "forward_kl":
        return _expectation(t, full_valid, t - s)  # KL(P_T || P_S)
    if kind == "reverse_kl":
        return _expectation(s, full_valid, s - t)  # KL(P_S || P_T)
    raise ValueError(f"unknown divergence {kind!r}; choose jsd, forward_kl or reverse_kl")


def truncated_importance_weight(logp: torch.Tensor, old_logp: torch.Tensor, clip: float) -> torch.Tensor:
    """min(exp(logp_θ - old_logp), clip) per position of one response [T], detached: it reweights, it is not optimised."""
    return torch.exp(logp.detach().float() - old_logp.float()).clamp(max=clip)


def prefix_importance_weight(logp: torch.Tensor, old_logp: torch.Tensor, clip: float) -> torch.Tensor:
    """min(Π_{j<t} exp(logp_θ,j - old_logp_j), clip) per position t of one response [T], detached: the ratio of the
    prefix y_<t that makes the state s_t = (x, y_<t), 1 at t = 0. The divergence at s_t depends on the state only, so
    this product, not the ratio of the token sampled at t, is what turns an expectation over states reached by the
    rollout policy into one over states the current policy reaches (per-decision importance sampling); the clip
    bounds its variance, at a bias, as the token weight's does."""
    log_ratio = logp.detach().float() - old_logp.float()
    before = torch.cumsum(log_ratio, 0) - log_ratio  # Σ_{j<t}
    return torch.exp(before).clamp(max=clip)  # exactly the clip where it binds (an overflow to inf included)


IMPORTANCE_WEIGHTS = {"token": truncated_importance_weight, "prefix": prefix_importance_weight}


def lt_opd_token_losses(
    student_lp: torch.Tensor,
    teacher_lp: torch.Tensor,
    valid: torch.Tensor,
    sampled_column: int,
    old_logp: torch.Tensor,
    kind: Divergence,
    alpha: float,
    importance_clip: float,
    importance: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted per-position loss [P], its divergence [P] and importance weights [P] of one response.

    `sampled_column` is the column of U holding the sampled token; it carries the
    sampled token's log-prob even where the column is masked as a duplicate. `importance`: the paper's weight of
    the token sampled at each position (`token`), or of the prefix before it (`prefix`; `IMPORTANCE_WEIGHTS`).
    """
    div = divergence(student_lp, teacher_lp, valid, kind, alpha)
    weight = IMPORTANCE_WEIGHTS[importance](student_lp[:, sampled_column], old_logp, importance_clip)
    return weight * div, div, weight
