"""The transformers teacher's scoring head at a real vocabulary: top-k log-probs and requested log-probs per position.

`core/objective.top_k_log_probs` ranks each chunk's logits and shifts only the k + requested entries by the row's
log-normaliser; the alternative beside it shifts the whole [chunk, V] logits into log-probs first, then ranks and
gathers. Same inputs, same chunking, one thread; the values agree exactly, and the printout says whether the ids do
(they may differ only in the order of log-probs that round to the same float). The matmul alone is the floor.

    python benchmarks/bench_teacher_topk.py                      # V = 248,320, 2,048 positions, chunk 256, top-100
    python benchmarks/bench_teacher_topk.py --positions 512 --chunk 64
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lt_opd_ray.core.objective import top_k_log_probs
from timing import best_of


def shifted_first(hidden: torch.Tensor, weight: torch.Tensor, k: int, chunk: int, requested: torch.Tensor):
    """Log-probs of the whole chunk, then their top k and the requested entries."""
    top_ids, top_lp, requested_lp = [], [], []
    for start in range(0, hidden.shape[0], chunk):
        logits = F.linear(hidden[start : start + chunk], weight).float()
        log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        values, ids = torch.topk(log_probs, k, dim=-1)
        top_ids.append(ids)
        top_lp.append(values)
        requested_lp.append(log_probs.gather(-1, requested[start : start + chunk]))
    return torch.cat(top_ids), torch.cat(top_lp), torch.cat(requested_lp)


def matmul_only(hidden: torch.Tensor, weight: torch.Tensor, chunk: int) -> None:
    for start in range(0, hidden.shape[0], chunk):
        F.linear(hidden[start : start + chunk], weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(1)  # an actor's share of a 2-core box
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=generator) * 0.05
    hidden = torch.randn(args.positions, args.hidden, generator=generator)
    requested = torch.randint(0, args.vocab, (args.positions, args.top_k + 1), generator=generator)

    ours_s, ours = best_of(args.repeats, lambda: top_k_log_probs(hidden, weight, args.top_k, args.chunk, requested))
    shifted_s, shifted = best_of(args.repeats, lambda: shifted_first(hidden, weight, args.top_k, args.chunk, requested))
    matmul_s, _ = best_of(args.repeats, lambda: matmul_only(hidden, weight, args.chunk))
    print(f"V = {args.vocab:,}, hidden {args.hidden}, {args.positions:,} positions in chunks of {args.chunk}, top-{args.top_k}"
          f" + {args.top_k + 1} requested, 1 thread, best of {args.repeats}")
    print(f"{'':<34} {'seconds':>8} {'vs ours':>8}")
    for name, seconds in (("ours (rank logits, shift k)", ours_s), ("log-probs first", shifted_s), ("the matmul alone", matmul_s)):
        print(f"{name:<34} {seconds:>8.2f} {seconds / ours_s:>7.2f}x")
    same_values = torch.equal(ours[1], shifted[1]) and torch.equal(ours[2], shifted[2])
    print(f"top-k and requested log-probs identical: {same_values}; ids identical: {torch.equal(ours[0], shifted[0])}")


if __name__ == "__main__":
    main()
