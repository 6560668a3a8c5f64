"""The batched draw (`choose`) against a brute-force reference: each id's share of the uniforms is its probability."""

import pytest
import torch

from lt_opd_ray.models.sampler import SamplingParams, choose


def reference_probabilities(log_probs: list[float], temperature: float, top_p: float) -> list[float]:
    """Temperature, then the smallest set of most likely ids whose mass reaches top_p, renormalised (float64, one row)."""
    weights = [torch.tensor(x / temperature, dtype=torch.float64).exp().item() for x in log_probs]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    return [p / mass if i in kept else 0.0 for i, p in enumerate(probs)]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (1.3, 0.5)])
def test_each_id_takes_its_probability_of_the_uniforms(temperature, top_p):
    generator = torch.Generator().manual_seed(3)
    log_probs = torch.log_softmax(2 * torch.randn(3, 12, generator=generator), -1)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    grid = 20000
    uniforms = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    for row in range(3):
        picks = choose(log_probs[row].expand(grid, -1), params, uniforms.float())
        shares = torch.bincount(picks, minlength=12).double() / grid
        want = torch.tensor(reference_probabilities(log_probs[row].tolist(), temperature, top_p), dtype=torch.float64)
        assert (shares - want).abs().max().item() < 2e-4, (row, shares, want)
        assert set(picks.tolist()) == set(torch.nonzero(want)[:, 0].tolist())


def test_a_uniform_at_the_top_never_picks_an_id_without_mass():
    log_probs = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, -30.0, -30.0]]), -1)
    below_one = torch.tensor([1.0 - 2**-24])
    assert choose(log_probs, SamplingParams(top_p=0.5), below_one).item() == 0
    assert choose(log_probs, SamplingParams(), below_one).item() == 2  # ids 3 and 4 add nothing an fp32 sum can hold
    assert choose(log_probs, SamplingParams(top_p=0.9), below_one).item() == 1  # the nucleus is {0, 1}


def test_a_row_draws_the_same_alone_as_in_a_batch():
    generator = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(torch.randn(6, 50, generator=generator), -1)
    uniforms = torch.rand(6, generator=generator)
    for params in (SamplingParams(), SamplingParams(top_p=0.9, temperature=0.8), SamplingParams(greedy=True)):
        together = choose(log_probs, params, uniforms)
        alone = torch.cat([choose(log_probs[i : i + 1], params, uniforms[i : i + 1]) for i in range(6)])
        assert torch.equal(together, alone)
    assert torch.equal(choose(log_probs, SamplingParams(greedy=True), uniforms), log_probs.argmax(-1))
