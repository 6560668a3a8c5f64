"""The objective against a brute-force reference built from explicit probability vectors."""

import math

import numpy as np
import pytest
import torch

from lt_opd_ray.core.objective import (
    IMPORTANCE_WEIGHTS,
    divergence,
    gather_log_probs,
    lt_opd_token_losses,
    prefix_importance_weight,
    top_k_log_probs,
    union_support,
)

KINDS = ["jsd", "forward_kl", "reverse_kl"]


def reference_divergence(p_s_full, p_t_full, support, kind, alpha):
    """Explicit probability vectors over the distinct ids of `support` plus one tail bin, float64.

    The tail holds the leftover mass, floored at 1 - exp(-1e-7) as docs/architecture.md §1 specifies
    (the min(logsumexp, -1e-7) clamp), so a tail of ~0 stays a finite log.
    """
    distinct = sorted(set(int(i) for i in support))
    tail_floor = -math.expm1(-1e-7)

    def with_tail(p_full):
        inside = [p_full[i] for i in distinct]
        return np.array(inside + [max(1.0 - sum(inside), tail_floor)])

    p_s, p_t = with_tail(p_s_full), with_tail(p_t_full)

    def kl(p, q):
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)

    if kind == "jsd":
        m = (1 - alpha) * p_s + alpha * p_t
        return (1 - alpha) * kl(p_s, m) + alpha * kl(p_t, m)
    if kind == "forward_kl":
        return kl(p_t, p_s)
    return kl(p_s, p_t)


def make_case(seed, positions=6, vocab=40, k=5, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    s_logits = torch.randn(positions, vocab, generator=g, dtype=torch.float64) * sharp
    t_logits = torch.randn(positions, vocab, generator=g, dtype=torch.float64) * sharp
    s_lp, t_lp = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    s_top = s_lp.topk(k, dim=-1).indices
    t_top = t_lp.topk(k, dim=-1).indices
    sampled = torch.multinomial(s_lp.exp(), 1, generator=g)
    ids, valid = union_support(s_top, t_top, sampled)
    return s_lp, t_lp, ids, valid


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha", [0.5, 0.1, 0.9])
@pytest.mark.parametrize("seed", range(4))
def test_divergence_equals_explicit_probability_reference(kind, alpha, seed):
    s_lp, t_lp, ids, valid = make_case(seed)
    got = divergence(s_lp.gather(-1, ids).float(), t_lp.gather(-1, ids).float(), valid, kind, alpha)
    for p in range(ids.shape[0]):
        expected = reference_divergence(s_lp[p].exp().numpy(), t_lp[p].exp().numpy(), ids[p].tolist(), kind, alpha)
        assert got[p].item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_whole_vocabulary_support_equals_exact_full_divergence(kind):
    s_lp, t_lp, _, _ = make_case(11, vocab=30)
    ids = torch.arange(30).repeat(s_lp.shape[0], 1)
    ids, valid = union_support(ids, ids[:, :3])  # duplicates of a full support change nothing
    got = divergence(s_lp.gather(-1, ids).float(), t_lp.gather(-1, ids).float(), valid, kind, 0.5)
    p_s, p_t = s_lp.exp(), t_lp.exp()
    if kind == "jsd":
        m = 0.5 * (p_s + p_t)
        exact = 0.5 * (p_s * (s_lp - m.log())).sum(-1) + 0.5 * (p_t * (t_lp - m.log())).sum(-1)
    elif kind == "forward_kl":
        exact = (p_t * (t_lp - s_lp)).sum(-1)
    else:
        exact = (p_s * (s_lp - t_lp)).sum(-1)
    torch.testing.assert_close(got.double(), exact, atol=1e-6, rtol=0)


def test_union_masks_duplicates_and_keeps_first_occurrence():
    a = torch.tensor([[5, 3, 9]])
    b = torch.tensor([[3, 7, 5]])
    c = torch.tensor([[9]])
    ids, valid = union_support(a, b, c)
    assert ids.tolist() == [[5, 3, 9, 3, 7, 5, 9]]
    assert valid.tolist() == [[True, True, True, False, True, False, False]]


@pytest.mark.parametrize("kind", KINDS)
def test_duplicate_ids_are_not_double_counted(kind):
    s_lp, t_lp, ids, valid = make_case(3)
    base = divergence(s_lp.gather(-1, ids).float(), t_lp.gather(-1, ids).float(), valid, kind)
    doubled_ids, doubled_valid = union_support(ids, ids)  # every id appears twice
    doubled = divergence(
        s_lp.gather(-1, doubled_ids).float(), t_lp.gather(-1, doubled_ids).float(), doubled_valid & torch.cat([valid, valid], -1), kind
    )
    torch.testing.assert_close(doubled, base, atol=1e-7, rtol=0)
    assert doubled_valid.sum() == valid.sum()


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_only_the_student(kind):
    s_lp, t_lp, ids, valid = make_case(5)
    student = s_lp.gather(-1, ids).float().requires_grad_(True)
    teacher = t_lp.gather(-1, ids).float().requires_grad_(True)
    old_logp = student.detach()[:, -1] - 0.3
    loss, _, weight = lt_opd_token_losses(student, teacher, valid, -1, old_logp, kind, 0.5, 2.0)
    loss.sum().backward()
    assert teacher.grad is None
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert not weight.requires_grad
    # the weight is a constant: the gradient equals weight * d(divergence)
    student2 = student.detach().clone().requires_grad_(True)
    (weight * divergence(student2, teacher.detach(), valid, kind)).sum().backward()
    torch.testing.assert_close(student.grad, student2.grad)
    # masked duplicate columns get no gradient from the divergence beyond the importance weight's path
    assert torch.all(student.grad[~valid] == 0)


def test_importance_weight_is_truncated():
    s_lp, t_lp, ids, valid = make_case(6)
    student = s_lp.gather(-1, ids).float()
    old_logp = student[:, -1] - torch.tensor([0.0, 0.5, 1.0, 5.0, -2.0, 0.1])
    _, _, weight = lt_opd_token_losses(student, t_lp.gather(-1, ids).float(), valid, -1, old_logp, "jsd", 0.5, 2.0)
    expected = torch.exp(torch.tensor([0.0, 0.5, 1.0, 5.0, -2.0, 0.1])).clamp(max=2.0)
    torch.testing.assert_close(weight, expected)


def test_the_prefix_weight_is_the_product_of_the_earlier_ratios_truncated():
    log_ratio = torch.tensor([0.5, -1.0, 2.0, 0.3])
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    weight = prefix_importance_weight(logp, logp - log_ratio, clip=2.0)
    by_hand = [1.0, math.exp(0.5), math.exp(0.5 - 1.0), min(math.exp(0.5 - 1.0 + 2.0), 2.0)]
    torch.testing.assert_close(weight, torch.tensor(by_hand))
    assert float(weight[3]) == 2.0  # exactly the clip where it binds: the clipped share counts it
    far = prefix_importance_weight(torch.zeros(3), torch.full((3,), -100.0), clip=2.0)  # a ratio past float32's range
    assert far.tolist() == [1.0, 2.0, 2.0]


def test_on_two_steps_enumerated_the_prefix_weight_recovers_the_current_policys_expected_divergence():
    """Two positions over two tokens. The rollouts come from an older policy mu; the loss wants the current policy
    pi's expected divergence, d1 at the first state plus d2(y1) at the second, which depends on the first token.
    Every response is enumerated with its probability under mu and weighted by our `IMPORTANCE_WEIGHTS` (clip
    large enough not to bind): `prefix` gives pi's expectation exactly; `token` (the paper's) gives mu's, because
    the ratio of the token sampled at a state averages to 1 over mu's draws there."""
    mu_first, pi_first = torch.tensor([0.7, 0.3]), torch.tensor([0.4, 0.6])
    mu_second, pi_second = torch.tensor([[0.5, 0.5], [0.9, 0.1]]), torch.tensor([[0.2, 0.8], [0.6, 0.4]])  # [y1, y2]
    d1, d2 = 0.25, torch.tensor([1.0, 3.0])  # the divergence at s_1, and at s_2 after each first token
    target = d1 + float((pi_first * d2).sum())  # E_pi[D(s_1) + D(s_2)]
    behaviour = d1 + float((mu_first * d2).sum())  # E_mu[...]: what no weighting does
    got = {}
    for name, weigh in IMPORTANCE_WEIGHTS.items():
        total = 0.0
        for y1 in range(2):
            for y2 in range(2):
                old = torch.log(torch.stack([mu_first[y1], mu_second[y1, y2]]))
                new = torch.log(torch.stack([pi_first[y1], pi_second[y1, y2]]))
                w = weigh(new, old, clip=1e6)
                total += float(mu_first[y1] * mu_second[y1, y2]) * float(w[0] * d1 + w[1] * d2[y1])
        got[name] = total
    assert got["prefix"] == pytest.approx(target, rel=1e-6)
    assert got["token"] == pytest.approx(behaviour, rel=1e-6) and abs(behaviour - target) > 0.1


@pytest.mark.parametrize("kind", KINDS)
def test_support_holding_almost_all_mass_is_finite_and_correct(kind):
    # very sharp distributions: the top-5 union holds all but ~1e-12 of the mass
    s_lp, t_lp, ids, valid = make_case(7, sharp=12.0)
    student = s_lp.gather(-1, ids).requires_grad_(True)  # fp64: log-probs near -100 lose 1e-5 in fp32
    got = divergence(student, t_lp.gather(-1, ids), valid, kind)
    got.sum().backward()
    assert torch.isfinite(got).all() and torch.isfinite(student.grad).all()
    for p in range(ids.shape[0]):
        expected = reference_divergence(s_lp[p].exp().numpy(), t_lp[p].exp().numpy(), ids[p].tolist(), kind, 0.5)
        assert got[p].item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_inputs_are_finite_and_match_fp32_of_the_same_values(kind):
    s_lp, t_lp, ids, valid = make_case(8)
    s16, t16 = s_lp.gather(-1, ids).bfloat16(), t_lp.gather(-1, ids).bfloat16()
    got = divergence(s16, t16, valid, kind)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, divergence(s16.float(), t16.float(), valid, kind))


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_log_softmax_equals_full_log_softmax(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 50, (10, 4), generator=g)
    got = gather_log_probs(hidden, weight, ids, chunk)
    full = (hidden @ weight.T).log_softmax(-1).gather(-1, ids)
    torch.testing.assert_close(got, full)
    got.sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full.sum().backward()
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def test_top_k_log_probs_brute_force():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(40, 8, generator=g)
    requested = torch.randint(0, 40, (9, 3), generator=g)
    ids, lp, req = top_k_log_probs(hidden, weight, 5, 4, requested)
    full = (hidden @ weight.T).log_softmax(-1)
    for p in range(9):
        order = sorted(range(40), key=lambda v: -full[p, v].item())[:5]
        assert ids[p].tolist() == order
    torch.testing.assert_close(lp, full.gather(-1, ids))
    torch.testing.assert_close(req, full.gather(-1, requested))


def test_unknown_divergence_and_bad_alpha_are_refused():
    s_lp, t_lp, ids, valid = make_case(0)
    with pytest.raises(ValueError, match="unknown divergence 'tvd'"):
        divergence(s_lp.gather(-1, ids), t_lp.gather(-1, ids), valid, "tvd")
    with pytest.raises(ValueError, match="alpha"):
        divergence(s_lp.gather(-1, ids), t_lp.gather(-1, ids), valid, "jsd", 1.0)
