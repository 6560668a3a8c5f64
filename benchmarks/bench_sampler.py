"""The transformers rollout backend's per-token draw at a real vocabulary: one token from one row's log-probs.

`models/sampler._choose` draws by inverse CDF (a float64 cumulative sum and one uniform); torch.multinomial, what it
drew with before, draws one exponential per vocabulary entry. Both run on the same log-probs, the same number of
times, side by side; the mean of many draws of each is the same distribution (tests/test_adapter.py checks the
frequencies against the exact probabilities).

    python benchmarks/bench_sampler.py                 # V = 248,320 (Qwen3.5), 1 thread
    python benchmarks/bench_sampler.py --vocab 151936
"""

from __future__ import annotations

import argparse
import time

import torch

from lt_opd_ray.models.sampler import SamplingParams, _choose


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
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rollout worker with 0.5-1 CPU runs 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    log_probs = torch.log_softmax(torch.randn(args.vocab, generator=torch.Generator().manual_seed(0)) * 3, -1)
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams()
    inverse_cdf = per_draw_ms(lambda: _choose(log_probs, params, generator), args.repeats)
    multinomial = per_draw_ms(lambda: int(torch.multinomial(torch.softmax(log_probs, -1), 1, generator=generator)), args.repeats)
    print(f"V = {args.vocab:,}, {args.threads} thread(s), mean of {args.repeats} draws")
    print(f"{'draw':<28} {'ms / token':>10}")
    print(f"{'torch.multinomial':<28} {multinomial:>10.3f}")
    print(f"{'inverse CDF (_choose)':<28} {inverse_cdf:>10.3f}")
    print(f"speed-up: {multinomial / inverse_cdf:.1f}x; a 1,024-token response of 8 rows: {8 * 1024 * multinomial / 1000:.1f} s"
          f" -> {8 * 1024 * inverse_cdf / 1000:.1f} s of drawing")


if __name__ == "__main__":
    main()
