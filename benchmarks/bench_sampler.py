"""The transformers rollout backend's per-token draw at a real vocabulary: one token per row of a decode step.

`models/sampler.choose_tokens` draws a decode step's rows by inverse CDF (a float64 cumulative sum and one uniform per
row: on the CPU a row at a time, on a GPU all at once); torch.multinomial draws one exponential per vocabulary entry. Both run
on the same log-probs, the same number of times, side by side; the mean of many draws of each is the same
distribution (tests/test_adapter.py checks the frequencies against the exact probabilities).

    python benchmarks/bench_sampler.py                 # V = 248,320 (Qwen3.5), 8 rows, 1 thread
    python benchmarks/bench_sampler.py --vocab 151936 --rows 1
"""

from __future__ import annotations

import argparse
import time

import torch

from lt_opd_ray.models.sampler import SamplingParams, choose_tokens


def per_draw_ms(draw, repeats: int) -> float:
    draw()
    begin = time.perf_counter()
    for _ in range(repeats):
        draw()
    return (time.perf_counter() - begin) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rows", type=int, default=8, help="rows of one decode step (a prompt's responses)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rollout worker with 0.5-1 CPU runs 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    log_probs = torch.log_softmax(torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3, -1)
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams()
    inverse_cdf = per_draw_ms(lambda: choose_tokens(log_probs, params, torch.rand(args.rows, generator=generator, dtype=torch.float64)),
                              args.repeats) / args.rows
    multinomial = per_draw_ms(lambda: [int(torch.multinomial(torch.softmax(row, -1), 1, generator=generator)) for row in log_probs],
                              args.repeats) / args.rows
    print(f"V = {args.vocab:,}, {args.rows} row(s) a step, {args.threads} thread(s), mean of {args.repeats} steps")
    print(f"{'draw':<34} {'ms / token':>10}")
    print(f"{'torch.multinomial, row by row':<34} {multinomial:>10.3f}")
    print(f"{'inverse CDF (choose_tokens)':<34} {inverse_cdf:>10.3f}")
    print(f"speed-up: {multinomial / inverse_cdf:.1f}x; a 1,024-token response of 8 rows: {8 * 1024 * multinomial / 1000:.1f} s"
          f" -> {8 * 1024 * inverse_cdf / 1000:.1f} s of drawing")


if __name__ == "__main__":
    main()
