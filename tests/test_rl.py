"""The RL baselines' losses (`core/rl.py`) against per-response loops written from the papers' formulas."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from lt_opd_ray.core.rl import CLIP_RANGES, group_advantages, policy_loss


def test_group_advantages_are_each_groups_centred_rewards_over_its_sample_std():
    """The last group's spread (1e-6) is the size of the eps the spread is offset by: there an eps of 1e-8, or none,
    doubles its advantages."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 2e-6])
    for scale in (True, False):
        got = group_advantages(rewards, 4, scale=scale)
        expected = []
        for g in range(4):
            group = rewards[4 * g : 4 * g + 4].tolist()
            mean, std = statistics.fmean(group), statistics.stdev(group)  # unbiased, as torch.std
            expected += [(r - mean) / (std + 1e-6) if scale else r - mean for r in group]
        torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-12)
        assert torch.equal(got[4:8], torch.zeros(4))  # a group whose rewards are all equal teaches nothing
    assert torch.equal(group_advantages(torch.tensor([3.0, 1.0]), 1), torch.zeros(2))  # one response per prompt
    with pytest.raises(ValueError, match=r"rewards of shape \(5,\) do not split into groups of 2"):
        group_advantages(torch.ones(5), 2)


DUAL_CLIP = 3.0  # verl's clip_ratio_c


def brute_force(logprobs, old, advantages, lengths, kind, low, high, dual_clip=DUAL_CLIP) -> torch.Tensor:
    """Response by response, token by token, as the papers write them, with verl's bounds (core_algos: a token's
    log-ratio clamped to ±20, GSPO's sequence log-ratio to at most 10; the dual clip as its three losses)."""
    terms, all_tokens = [], []
    for i, length in enumerate(lengths):
        a = advantages[i]
        if kind == "gspo":
            s = torch.exp(torch.clamp(sum(logprobs[i, t] - old[i, t] for t in range(length)) / length, max=10.0))
            terms.append(-torch.minimum(s * a, torch.clamp(s, 1 - low, 1 + high) * a))
            continue
        tokens = []
        for t in range(length):
            r = torch.exp(torch.clamp(logprobs[i, t] - old[i, t], -20.0, 20.0))
            clipped = torch.maximum(-a * r, -a * torch.clamp(r, 1 - low, 1 + high))  # verl's pg_losses1 / 2
            if dual_clip is not None and a < 0:
                clipped = torch.minimum(-a * dual_clip, clipped)  # pg_losses3 caps it where A < 0
            tokens.append(clipped)
        terms.append(sum(tokens) / length)
        all_tokens += tokens
    if kind == "dapo":
        return sum(all_tokens) / sum(lengths)
    return sum(terms) / len(terms)


@pytest.mark.parametrize("dual_clip", [DUAL_CLIP, None])
@pytest.mark.parametrize("kind", ["grpo", "dapo", "gspo"])
def test_each_loss_and_its_gradient_equal_the_papers_formula_response_by_response(kind, dual_clip):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7, 3]
    B, T = len(lengths), max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    old = -torch.rand(B, T, generator=g) * 3
    spread = 0.5 if kind != "gspo" else 2e-3  # ratios on both sides of the clip range
    logprobs = (old + torch.randn(B, T, generator=g) * spread).requires_grad_(True)
    if kind != "gspo":  # tokens far above their old log-prob: past the dual clip (A < 0), and past verl's ±20 clamp
        logprobs = (logprobs.detach() + torch.tensor([0.0, 2.0, 0.0, 25.0])[:, None] * (torch.arange(T) == 1)).requires_grad_(True)
    advantages = torch.tensor([1.5, -0.7, 0.3, -1.2])
    low, high = CLIP_RANGES[kind]
    loss = policy_loss(logprobs, old, advantages, mask, kind=kind, clip_low=low, clip_high=high, dual_clip=dual_clip)
    (grad,) = torch.autograd.grad(loss, logprobs)
    reference_input = logprobs.detach().double().requires_grad_(True)
    reference = brute_force(reference_input, old.double(), advantages.double(), lengths, kind, low, high, dual_clip)
    (reference_grad,) = torch.autograd.grad(reference, reference_input)
    assert float(loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)
    torch.testing.assert_close(grad.double(), reference_grad, rtol=1e-4, atol=1e-7)
    assert torch.equal(grad[mask == 0], torch.zeros_like(grad[mask == 0]))  # padding gets no gradient
    ratios = torch.exp(logprobs.detach() - old)
    if kind != "gspo":  # the clip binds somewhere: a token pushed past 1 + high with A > 0 gets no gradient
        binding = (ratios > 1 + high) & (advantages[:, None] > 0) & (mask > 0)
        assert bool(binding.any()) and torch.equal(grad[binding], torch.zeros_like(grad[binding]))
        capped = (ratios > DUAL_CLIP) & (advantages[:, None] < 0) & (mask > 0)  # the tokens moved by 2 and 25
        assert int(capped.sum()) == 2
        assert torch.equal(grad[capped], torch.zeros_like(grad[capped])) == (dual_clip is not None)


def test_dual_clip_and_log_ratio_clamp_by_hand():
    """One token each, GRPO's range 0.2 / 0.2: the values verl's compute_policy_loss gives, worked out by hand."""
    one = torch.ones(1, 1)

    def term(log_ratio, advantage, dual_clip=3.0):
        return float(policy_loss(torch.tensor([[log_ratio]]), torch.zeros(1, 1), torch.tensor([advantage]), one,
                                 kind="grpo", clip_low=0.2, clip_high=0.2, dual_clip=dual_clip))

    assert term(math.log(2.0), -1.5) == pytest.approx(2.0 * 1.5)  # r = 2 under the cap: r |A|
    assert term(math.log(5.0), -1.5) == pytest.approx(3.0 * 1.5)  # r = 5 over it: c |A|
    assert term(math.log(5.0), -1.5, dual_clip=None) == pytest.approx(5.0 * 1.5)  # no cap: r |A|
    assert term(math.log(5.0), -1.5, dual_clip=4.0) == pytest.approx(4.0 * 1.5)  # the configured c
    assert term(math.log(5.0), 1.5) == pytest.approx(-1.2 * 1.5)  # A > 0: the upper clip, untouched by the cap
    assert term(30.0, -1.0, dual_clip=None) == pytest.approx(math.exp(20.0), rel=1e-6)  # clamped at e^20, finite


def test_on_policy_every_loss_is_the_policy_gradient_of_its_average():
    """Ratio 1 everywhere (one minibatch, staleness 0): the loss is -mean A (per response, or per token for DAPO) and
    its gradient on a token's log-prob is -A_i / (B T_i) for GRPO, -A_i / Σ T for DAPO, -A_i / (B T_i) for GSPO."""
    lengths, advantages = [4, 1, 3], torch.tensor([2.0, -1.0, 0.5])
    B, T = 3, 4
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    old = -torch.rand(B, T, generator=torch.Generator().manual_seed(1))
    for kind, per_token in (("grpo", lambda i: 1 / (B * lengths[i])), ("dapo", lambda i: 1 / sum(lengths)), ("gspo", lambda i: 1 / (B * lengths[i]))):
        logprobs = old.clone().requires_grad_(True)
        low, high = CLIP_RANGES[kind]
        loss = policy_loss(logprobs, old, advantages, mask, kind=kind, clip_low=low, clip_high=high, dual_clip=DUAL_CLIP)
        (grad,) = torch.autograd.grad(loss, logprobs)
        expected_loss = -sum(a * n for a, n in zip(advantages.tolist(), lengths)) / sum(lengths) if kind == "dapo" else -float(advantages.mean())
        assert float(loss.detach()) == pytest.approx(expected_loss, rel=1e-6), kind
        expected = torch.tensor([[-float(advantages[i]) * per_token(i) if t < lengths[i] else 0.0 for t in range(T)] for i in range(B)])
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind", ["grpo", "dapo", "gspo"])
def test_padding_that_holds_minus_infinity_changes_neither_the_loss_nor_its_gradient(kind):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -float("inf")], [-0.5, -float("inf"), -float("inf")]])
    logprobs = torch.tensor([[-0.9, -2.1, -float("inf")], [-0.6, -float("inf"), -float("inf")]], requires_grad=True)
    low, high = CLIP_RANGES[kind]
    loss = policy_loss(logprobs, old, torch.tensor([1.0, -1.0]), mask, kind=kind, clip_low=low, clip_high=high,
                       dual_clip=DUAL_CLIP)
    (grad,) = torch.autograd.grad(loss, logprobs)
    finite = lambda t: torch.where(mask > 0, t.detach(), torch.zeros(())).requires_grad_(t.requires_grad)  # noqa: E731
    same_input = finite(logprobs)
    same = policy_loss(same_input, finite(old), torch.tensor([1.0, -1.0]), mask, kind=kind, clip_low=low, clip_high=high, dual_clip=DUAL_CLIP)
    assert torch.isfinite(loss) and float(loss.detach()) == pytest.approx(float(same.detach()))
    torch.testing.assert_close(grad, torch.autograd.grad(same, same_input)[0])


def test_a_response_with_no_tokens_or_an_unknown_loss_is_refused():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match=r"response\(s\) \[1\] have no tokens under the mask"):
        policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2), mask, kind="grpo", clip_low=0.2, clip_high=0.2, dual_clip=DUAL_CLIP)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), kind="ppo", clip_low=0.2, clip_high=0.2, dual_clip=DUAL_CLIP)
