"""Peak memory of the LT-OPD loss (forward + backward) at B*T positions and a Qwen3.5-size vocabulary.

Chunked log-softmax (ours) against a naive full-vocabulary log-softmax that
materialises [B*T, V] fp32 logits. Each measurement runs in a fresh subprocess and
reports its peak RSS above the RSS right before the loss (inputs already allocated).
The naive loss needs ~3 x P x V x 4 bytes (24 GB at P = 8192), more than this
machine has, so it is measured at smaller P and extrapolated linearly (its memory
is linear in P; the printout shows the fit). Hidden size is 128: logits memory does
not depend on it, and it keeps the 8192 x 248,320 matmuls to tens of seconds on 2 cores.

    python benchmarks/bench_objective.py            # full table (a few minutes)
    python benchmarks/bench_objective.py --quick    # smaller P, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

VOCAB = 248_320
HIDDEN = 128
TOP_K = 100


def measure(kind: str, positions: int, chunk: int) -> dict:
    code = f"""
import json, resource, time, torch
from lt_opd_ray.core.objective import gather_log_probs, lt_opd_token_losses, union_support
torch.manual_seed(0)
P, V, H, K = {positions}, {VOCAB}, {HIDDEN}, {TOP_K}
hidden = torch.randn(P, H, requires_grad=True)
weight = (torch.randn(V, H) * 0.05).requires_grad_(True)
ids, valid = union_support(torch.randint(0, V, (P, K)), torch.randint(0, V, (P, K)), torch.randint(0, V, (P, 1)))
teacher = torch.log_softmax(torch.randn(P, ids.shape[1]), -1)
old = torch.zeros(P)
def rss_kb():
    return int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize() // 1024
before = rss_kb()
start = time.perf_counter()
if "{kind}" == "chunked":
    student = gather_log_probs(hidden, weight, ids, {chunk})
else:
    student = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, ids)
loss, _, _ = lt_opd_token_losses(student, teacher, valid, ids.shape[1] - 1, old, "jsd", 0.5, 2.0)
loss.mean().backward()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"peak_mb": (peak - before) / 1024, "seconds": seconds, "loss": loss.mean().item()}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--chunk", type=int, default=1024)
    args = parser.parse_args()
    target = 1024 if args.quick else 8192
    naive_sizes = [128, 256, 512] if args.quick else [512, 1024, 2048]
    print(f"V = {VOCAB}, hidden = {HIDDEN}, top-k = {TOP_K}, chunk = {args.chunk}; peak RSS above inputs, fwd + bwd")
    print(f"{'P':>6} {'naive MB':>10} {'chunked MB':>11} {'naive s':>8} {'chunked s':>9}")
    naive_points = []
    for p in naive_sizes:
        naive, chunked = measure("naive", p, args.chunk), measure("chunked", p, args.chunk)
        naive_points.append((p, naive["peak_mb"]))
        print(f"{p:>6} {naive['peak_mb']:>10.0f} {chunked['peak_mb']:>11.0f} {naive['seconds']:>8.2f} {chunked['seconds']:>9.2f}")
    # least-squares line through the naive points: memory = a + b * P
    n = len(naive_points)
    mean_p = sum(p for p, _ in naive_points) / n
    mean_m = sum(m for _, m in naive_points) / n
    slope = sum((p - mean_p) * (m - mean_m) for p, m in naive_points) / sum((p - mean_p) ** 2 for p, _ in naive_points)
    naive_target = mean_m + slope * (target - mean_p)
    chunked = measure("chunked", target, args.chunk)
    print(f"{target:>6} {naive_target:>10.0f}* {chunked['peak_mb']:>10.0f} {'':>8} {chunked['seconds']:>9.2f}")
    print(f"* naive at P = {target} extrapolated: {slope:.2f} MB per position (theory 3 x V x 4 B = {3 * VOCAB * 4 / 2**20:.2f} MB)")
    print(f"RESULT P={target} V={VOCAB}: chunked {chunked['peak_mb']:.0f} MB vs naive {naive_target:.0f} MB -> ratio naive/chunked = {naive_target / chunked['peak_mb']:.1f}x")


if __name__ == "__main__":
    main()
