"""Selectors against independent brute-force references."""

import itertools

import numpy as np
import pytest
import torch

from lt_opd_ray.core.selectors import SELECTORS, EncoderAttention, SelectionInput, build_selector
from lt_opd_ray.core.selectors.cdpruner import CDPruner


def naive_cdpruner(features: np.ndarray, query: np.ndarray, k: int) -> list[int]:
    """Full N x N kernel in float64; greedy by explicit log-determinant of every candidate set."""
    v = features / np.linalg.norm(features, axis=1, keepdims=True)
    q = query / np.linalg.norm(query)
    cos = v @ q
    if cos.max() - cos.min() <= 1e-6:  # float32 noise: no relevance signal (the reference's rule)
        rho = np.ones(len(v))
    else:
        rho = np.clip((cos - cos.min()) / (cos.max() - cos.min()), 1e-6, 1.0)
    kernel = rho[:, None] * (v @ v.T) * rho[None, :] + 1e-6 * np.eye(len(v))
    chosen: list[int] = []
    for _ in range(k):
        best, best_logdet = None, -np.inf
        for i in range(len(v)):
            if i in chosen:
                continue
            idx = chosen + [i]
            sign, logdet = np.linalg.slogdet(kernel[np.ix_(idx, idx)])
            logdet = logdet if sign > 0 else -np.inf
            if logdet > best_logdet + 1e-9:  # ties (up to float64 rounding of the kernel) keep the lowest index
                best, best_logdet = i, logdet
        chosen.append(best)
    return sorted(chosen)


@pytest.mark.parametrize("seed", range(12))
def test_cdpruner_equals_naive_log_determinant_greedy(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(12, 60))
    d = int(rng.integers(16, 48))
    k = int(rng.integers(1, min(n, 12) + 1))
    features = rng.normal(size=(n, d)).astype(np.float32)
    query = rng.normal(size=d).astype(np.float32)
    got = CDPruner().select(SelectionInput(torch.from_numpy(features), torch.from_numpy(query), (1, n)), k)
    assert got.tolist() == naive_cdpruner(features.astype(np.float64), query.astype(np.float64), k)


def test_cdpruner_treats_a_relevance_spread_within_float32_noise_as_pure_diversity():
    from lt_opd_ray.core.selectors.cdpruner import greedy_dpp_map

    rng = np.random.default_rng(3)
    n, d, k = 24, 16, 6
    rest = rng.normal(size=(n, d - 1))
    rest /= np.linalg.norm(rest, axis=1, keepdims=True)
    along_query = 0.3 + 1e-8 * rng.permutation(n)  # cosines to the query differ by ~1e-7 at most
    features = torch.from_numpy(np.concatenate([along_query[:, None], rest], axis=1)).float()
    query = torch.zeros(d)
    query[0] = 1.0
    got = CDPruner().select(SelectionInput(features, query, (1, n)), k)
    assert got.tolist() == CDPruner().select(SelectionInput(features, None, (1, n)), k).tolist()
    assert got.tolist() == naive_cdpruner(features.double().numpy(), query.double().numpy(), k)
    unit = torch.nn.functional.normalize(features, dim=-1)
    cos = unit @ query
    stretched = ((cos - cos.min()) / (cos.max() - cos.min())).clamp(1e-6, 1.0)  # the noise blown up to [1e-6, 1]
    assert float(cos.max() - cos.min()) > 0 and sorted(greedy_dpp_map(unit, stretched, k).tolist()) != got.tolist()


def test_cdpruner_ties_go_to_the_lowest_index():
    # orthonormal, equally relevant tokens: every pick leaves the others' gains exactly equal
    features = torch.eye(10)
    got = CDPruner().select(SelectionInput(features, torch.ones(10), (2, 5)), 4)
    assert got.tolist() == [0, 1, 2, 3]


def test_cdpruner_reads_nothing_back_from_the_device():
    """Inside an engine's prefill the selection runs on the GPU: its k greedy picks and the relevance's flat test
    stay there (before: two values read back a pick, and indexing by the 0-dim pick read it again inside torch); the
    one copy to the host is the unit's chosen indices, which are recorded and replayed."""
    from device_reads import DeviceReads

    features, query = torch.randn(60, 32), torch.randn(32)
    with DeviceReads([features, query]) as reads:
        got = CDPruner().select(SelectionInput(features, query, (6, 10)), 15)
    assert [what for what, _ in reads.seen] == ["cpu: to the host"] and got.numel() == 15


def test_cdpruner_prefers_relevant_diverse_tokens():
    # two orthogonal clusters; the query points at cluster B: the first pick is from B
    a = torch.tensor([1.0, 0.0, 0.0]).repeat(5, 1)
    b = torch.tensor([0.0, 1.0, 0.0]).repeat(5, 1)
    features = torch.cat([a, b]) + 0.01 * torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    got = CDPruner().select(SelectionInput(features, torch.tensor([0.2, 1.0, 0.0]), (1, 10)), 1)
    assert got.item() >= 5


def naive_divprune(features: np.ndarray, k: int) -> list[int]:
    v = features / np.linalg.norm(features, axis=1, keepdims=True)
    dist = 1.0 - v @ v.T
    np.fill_diagonal(dist, np.inf)
    chosen = [int(np.argmax(dist.min(axis=1)))]
    np.fill_diagonal(dist, 0.0)
    while len(chosen) < k:
        score = dist[chosen].min(axis=0)
        score[chosen] = -np.inf
        chosen.append(int(np.argmax(score)))
    return sorted(chosen)


@pytest.mark.parametrize("seed", range(6))
def test_divprune_equals_naive_max_min(seed):
    rng = np.random.default_rng(100 + seed)
    n, d = int(rng.integers(8, 50)), int(rng.integers(4, 32))
    k = int(rng.integers(1, n + 1))
    features = rng.normal(size=(n, d))
    got = build_selector("divprune").select(SelectionInput(torch.from_numpy(features).float(), None, (1, n)), k)
    assert got.tolist() == naive_divprune(features, k)


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_every_selector_returns_k_sorted_distinct_indices(name):
    selector = build_selector(name)
    features = torch.randn(37, 16, generator=torch.Generator().manual_seed(3))
    attention = EncoderAttention(torch.rand(37), torch.rand(37))  # read by the selectors that read it (HiPrune)
    for k in (1, 5, 36, 37):
        got = selector.select(SelectionInput(features, torch.randn(16), (1, 37), seed=7, attention=attention,
                                             language_attention=torch.rand(37)), k)  # FastV's
        assert got.dtype == torch.long
        assert got.tolist() == sorted(set(got.tolist()))
        assert len(got) == k and 0 <= got.min() and got.max() < 37


def test_random_selector_is_seeded():
    features = torch.zeros(64, 4)
    def pick(seed):
        return build_selector("random").select(SelectionInput(features, None, (8, 8), seed=seed), 5)

    assert torch.equal(pick(1), pick(1))
    assert not torch.equal(pick(1), pick(2))


def test_uniform_grid_spreads_over_strata():
    got = build_selector("uniform").select(SelectionInput(torch.zeros(16, 2), None, (4, 4)), 4)
    assert got.tolist() == [2, 6, 10, 14]
    # every stratum of size N/k holds exactly one pick
    for n, k in itertools.product([7, 16, 33], [1, 3, 7]):
        got = build_selector("uniform").select(SelectionInput(torch.zeros(n, 2), None, (1, n)), k).tolist()
        assert [int(i * k // n) for i in got] == list(range(k))


@pytest.mark.parametrize("k", [0, 17])
def test_k_outside_one_to_n_is_refused(k):
    with pytest.raises(ValueError, match=rf"cannot keep k = {k} of N = 16"):
        build_selector("cdpruner").select(SelectionInput(torch.randn(16, 4), torch.randn(4), (4, 4)), k)


def test_the_job_schema_offers_every_selector_and_only_those():
    from typing import get_args

    from lt_opd_ray.config.schema import SelectorName

    assert sorted(get_args(SelectorName)) == sorted(SELECTORS)


def test_unknown_selector_is_named():
    with pytest.raises(ValueError, match="unknown selector 'tome'"):
        build_selector("tome")
