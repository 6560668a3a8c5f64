"""Time and memory of the selectors at Qwen3.5-4B scale: N = 4096 tokens, D = 2560, k = 205 (5%); HiPrune's
scores, the attention each patch receives in two blocks of Qwen3.5-4B's vision tower (4 x 4096 patches, 16 heads of 64),
beside the [heads, S, S] attention matrix that reading them from an eager kernel would hold; and FastV's, the last
prompt token's row at the language model's scoring layer (16 query heads, 4 key-value heads of 256, L = N + 84), beside
the [heads, L, L] matrix an eager kernel would return.

Peak memory is read from torch's profiler as the largest single tensor allocation
during selection, next to the size an N x N fp32 kernel would take, so a matrix-
free selector shows no N x N allocation. The explicit-kernel fast greedy (the
same algorithm with the full kernel precomputed) is timed alongside as the naive
baseline.

    python benchmarks/bench_selectors.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lt_opd_ray.core.selectors import EncoderAttention, SelectionInput, build_selector
from lt_opd_ray.core.selectors.cdpruner import KERNEL_RIDGE, relevance
from lt_opd_ray.core.selectors.hiprune import received_attention
from lt_opd_ray.models.lm_pruning import last_query_attention


def explicit_kernel_greedy(features: torch.Tensor, query: torch.Tensor, k: int) -> torch.Tensor:
    """The same fast greedy with L = diag(rho) V V^T diag(rho) + eps I materialised (N x N)."""
    v = torch.nn.functional.normalize(features.float(), dim=-1)
    rho = relevance(v, query)
    kernel = rho[:, None] * (v @ v.T) * rho[None, :] + KERNEL_RIDGE * torch.eye(v.shape[0])
    n = v.shape[0]
    c = torch.zeros(k, n)
    d2 = kernel.diagonal().clone()
    picked = []
    for t in range(k):
        j = int(torch.argmax(d2))
        picked.append(j)
        e = (kernel[j] - c[:t].T @ c[:t, j]) / torch.sqrt(d2[j])
        c[t] = e
        d2 = d2 - e * e
        d2[j] = -torch.inf
    return torch.sort(torch.tensor(picked)).values


def largest_allocation_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--d", type=int, default=2560)
    parser.add_argument("--k", type=int, default=205)
    parser.add_argument("--heads", type=int, default=16, help="vision tower heads (Qwen3.5-4B: 16 of 64)")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    features = torch.randn(args.n, args.d, generator=g)
    query = torch.randn(args.d, generator=g)
    item = SelectionInput(features, query, (64, args.n // 64), attention=EncoderAttention(torch.rand(args.n, generator=g), torch.rand(args.n, generator=g)),
                          language_attention=torch.rand(args.n, generator=g))
    patches = 4 * args.n  # a 2 x 2 merge
    q, k = torch.randn(args.heads, patches, 64, generator=g), torch.randn(args.heads, patches, 64, generator=g)
    nxn_mb = args.n * args.n * 4 / 2**20
    print(f"N = {args.n}, D = {args.d}, k = {args.k}; an N x N fp32 kernel is {nxn_mb:.1f} MB; features are {features.numel() * 4 / 2**20:.1f} MB")
    print(f"{'selector':<26} {'seconds':>8} {'largest alloc MB':>17} {'vs N x N':>9}")
    runs = {
        "cdpruner (matrix-free)": lambda: build_selector("cdpruner").select(item, args.k),
        "divprune": lambda: build_selector("divprune").select(item, args.k),
        "hiprune (given scores)": lambda: build_selector("hiprune").select(item, args.k),
        "fastv (given scores)": lambda: build_selector("fastv").select(item, args.k),
        "random": lambda: build_selector("random").select(item, args.k),
        "uniform": lambda: build_selector("uniform").select(item, args.k),
        "naive explicit kernel": lambda: explicit_kernel_greedy(features, query, args.k),
    }
    results = {}
    for name, fn in runs.items():
        fn()  # warm-up
        start = time.perf_counter()
        results[name] = fn()
        seconds = time.perf_counter() - start
        largest = largest_allocation_bytes(fn) / 2**20
        print(f"{name:<26} {seconds:>8.3f} {largest:>17.2f} {largest / nxn_mb:>8.2f}x")
    start = time.perf_counter()
    largest = largest_allocation_bytes(lambda: received_attention(q, k, [0, patches])) / 2**20  # one run, timed with the profiler on
    seconds = time.perf_counter() - start
    matrix_mb = args.heads * patches * patches * 4 / 2**20
    print(f"hiprune scores, one block of S = {patches} patches x {args.heads} heads: {seconds:.2f} s, largest allocation {largest:.1f} MB"
          f" against {matrix_mb:.0f} MB for the [heads, S, S] fp32 attention ({largest / matrix_mb:.4f}x); HiPrune scores two blocks")
    length = args.n + 84  # the language model's prompt: every visual token and the question's text
    lm_q, lm_k = torch.randn(1, 16, length, 256, generator=g), torch.randn(1, 4, length, 256, generator=g)
    last_query_attention(lm_q, lm_k, None, None)  # warm-up
    start = time.perf_counter()
    last_query_attention(lm_q, lm_k, None, None)
    seconds = time.perf_counter() - start
    largest = largest_allocation_bytes(lambda: last_query_attention(lm_q, lm_k, None, None)) / 2**20
    matrix_mb = 16 * length * length * 4 / 2**20
    print(f"fastv scores, the last prompt token's row at the scoring layer (L = {length}, 16 heads of 256): {seconds * 1e3:.1f} ms,"
          f" largest allocation {largest:.1f} MB against {matrix_mb:.0f} MB for the [heads, L, L] fp32 attention ({largest / matrix_mb:.4f}x)")
    same = torch.equal(results["cdpruner (matrix-free)"], results["naive explicit kernel"])
    print(f"cdpruner == explicit-kernel greedy: {same}")
    print("(the largest matrix-free allocation is the L2-normalised copy of the N x D features)")


if __name__ == "__main__":
    main()
