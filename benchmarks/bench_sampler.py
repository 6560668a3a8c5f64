"""The transformers sampler's draw per decode step: one row at a time (before) against the whole batch at once (after).

Before, each decode step looped over the batch's rows in Python: a softmax over the row's vocabulary and
`torch.multinomial` with the row's own generator, then the row's log-prob read as a Python float. Now
(`models/sampler.choose`) the batch's softmax, nucleus cut and cumulative sum are one tensor op each, and every
row takes the first id whose cumulative probability exceeds its own uniform (drawn up front from its own seed).
Both arms start from the same [B, V] log-probs; the head's GEMM and the log-softmax are outside the timing.

    python benchmarks/bench_sampler.py [--vocab 248320] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from lt_opd_ray.models.sampler import SamplingParams, choose


def per_row(log_probs: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> list[float]:
    """The previous draw, kept here as the baseline: a Python loop over rows, multinomial per row."""
    out = []
    for b, generator in enumerate(generators):
        probs = torch.softmax(log_probs[b] / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            sorted_probs[torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(float(log_probs[b, token]))
    return out


def batched(log_probs: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    token = choose(log_probs, params, uniforms)
    return log_probs.gather(1, token[:, None])[:, 0]


def best_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rollout actor of cpus < 1 gets 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"== one decode step's draw, V = {args.vocab}, fp32 log-probs, {args.threads} thread(s); best of 5")
    print("| rows | top_p | before (per row) ms | after (batched) ms | speed-up |\n|---|---|---|---|---|")
    for rows in (8, 16, 64):
        for top_p in (1.0, 0.9):
            log_probs = torch.log_softmax(torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)), -1)
            params = SamplingParams(top_p=top_p)
            generators = [torch.Generator().manual_seed(i) for i in range(rows)]
            uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(0))
            before = best_ms(lambda: per_row(log_probs, params, generators))
            after = best_ms(lambda: batched(log_probs, params, uniforms))
            print(f"| {rows} | {top_p:g} | {before:.1f} | {after:.1f} | {before / after:.1f}x |")


if __name__ == "__main__":
    main()
