"""The learner's top-k union U = student top-k ∪ teacher top-k ∪ {sampled} for one micro-batch, as the loss builds it
(`models/loss.supports_of`: every row of the micro-batch at once, on the device the loss runs on) against one union
per rollout built on the host and copied over (the loss before it). Main job's shapes by default: 8 rollouts of 1,024
response tokens, k = 100, vocabulary 248,320. Prints seconds per micro-batch (best of --repeats) and the bytes each
arm copies to the device; on a CPU the device is the host, so the copy's cost is not in the seconds.

    python benchmarks/bench_support.py [--rollouts 8] [--tokens 1024] [--top-k 100] [--device cpu]
"""

from __future__ import annotations

import argparse

import torch

from lt_opd_ray.core.objective import union_support
from lt_opd_ray.core.wire import Rollout, TeacherScore
from lt_opd_ray.models.loss import supports_of
from timing import best_of

VOCAB = 248_320


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device, k, T = torch.device(args.device), args.top_k, args.tokens
    g = torch.Generator().manual_seed(0)
    ids = lambda *shape: torch.randint(0, VOCAB, shape, generator=g)  # noqa: E731
    rollouts = [Rollout(prompt_index=0, response_ids=ids(T), old_logp=-torch.rand(T), student_top_ids=ids(T, k).to(torch.int32),
                        selected=[torch.arange(4)], budget_bps=500, finish_reason="stop")
                for _ in range(args.rollouts)]
    scores = [TeacherScore(top_ids=ids(T, k).to(torch.int32), top_logp=-torch.rand(T, k), requested_logp=-torch.rand(T, k + 1))
              for _ in rollouts]

    def per_rollout_on_host():
        out = []
        for r, s in zip(rollouts, scores):
            u, valid = union_support(r.student_top_ids, s.top_ids.long(), r.response_ids[:, None])
            req = s.requested_logp.float()
            teacher = torch.cat([req[:, :k], s.top_logp.float(), req[:, k:]], dim=-1)
            out.append([t.to(device) for t in (u, valid, teacher)])
        return out

    def micro_batch_on_device():
        return supports_of(rollouts, scores, device)

    host_s, host = best_of(args.repeats, per_rollout_on_host)
    device_s, built = best_of(args.repeats, micro_batch_on_device)
    assert all(torch.equal(a, b.to(a.device)) for x, y in zip(host, built) for a, b in zip(x, y)), "the arms disagree"
    rows = args.rollouts * T
    copied_before = rows * (2 * k + 1) * (8 + 1 + 4)  # ids int64, valid bool, teacher log-probs fp32
    copied_after = rows * (k * 4 + k * 4 + 8 + (k + 1) * 4 + k * 4)  # student and teacher ids int32, sampled id, log-probs
    print(f"{args.rollouts} rollouts x {T} tokens, k = {k}, device {device}, {torch.get_num_threads()} threads; the arms agree")
    print(f"{'arm':<28} {'ms / micro-batch':>17} {'MB to the device':>17}")
    print(f"{'per rollout, on the host':<28} {host_s * 1e3:>17.1f} {copied_before / 2**20:>17.1f}")
    print(f"{'micro-batch, on the device':<28} {device_s * 1e3:>17.1f} {copied_after / 2**20:>17.1f}")
    print(f"micro-batch on the device: {host_s / device_s:.2f}x the speed, {copied_before / copied_after:.2f}x fewer bytes copied")


if __name__ == "__main__":
    main()
