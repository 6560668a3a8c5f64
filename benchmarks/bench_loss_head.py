"""The loss's output-head gradient at Qwen3.5's vocabulary (V = 248,320): per-sequence fp32 buffers against one
buffer per micro-batch in the weight's dtype, peak memory and time side by side.

Before, the learner's loss ran the chunked log-softmax once per sequence, and each backward
allocated a fresh fp32 [V, H] gradient buffer, converted it to the weight's dtype and let
autograd add it into the head's .grad: at Qwen3.5-4B (H = 2560) 2.5 GB per sequence,
plus the copy. Now one call covers every response row of the micro-batch and accumulates
the head gradient chunk by chunk, in place, into one [V, H] buffer in the weight's dtype.

Each variant runs forward + backward of S sequences x T response rows in a fresh
subprocess; peak memory above what was allocated right before the loss (weights and
inputs): RSS on CPU, the CUDA allocator's peak on a GPU; the head's gradients of the
two variants are compared.

    python benchmarks/bench_loss_head.py [--hidden 512] [--sequences 4] [--tokens 128] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

VOCAB = 248_320
SUPPORT = 201  # student top-100 + teacher top-100 + the sampled token
CHUNK = 256

BEFORE = '''
class PerSequenceFp32(_ChunkedGatherLogProbs):  # the previous backward (the forward is today's): a fresh fp32 [V, H] buffer per call
    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, ids, lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            g = F.linear(hidden[rows], weight).float()
            g.sub_(lse[rows, None]).exp_()
            g.mul_(-grad_out[rows].sum(-1, keepdim=True))
            g.scatter_add_(-1, ids[rows], grad_out[rows].float())
            grad_hidden[rows] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += g.T @ hidden[rows].float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None
'''


def measure(variant: str, dtype: str, hidden: int, sequences: int, tokens: int, device: str) -> dict:
    code = f"""
import json, resource, time, torch
import torch.nn.functional as F
from lt_opd_ray.core.objective import _ChunkedGatherLogProbs, gather_log_probs
{BEFORE}
torch.manual_seed(0)
dtype = getattr(torch, {dtype!r})
device = {device!r}
weight = (torch.randn({VOCAB}, {hidden}, device=device) * 0.02).to(dtype).requires_grad_()
hidden = [torch.randn({tokens}, {hidden}, device=device).to(dtype).requires_grad_() for _ in range({sequences})]
ids = [torch.randint(0, {VOCAB}, ({tokens}, {SUPPORT}), device=device) for _ in range({sequences})]
def used_kb():
    if device == "cuda":
        return torch.cuda.memory_allocated() // 1024
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
before = used_kb()
begin = time.perf_counter()
if {variant!r} == "before":
    for h, i in zip(hidden, ids):
        PerSequenceFp32.apply(h, weight, i, {CHUNK}).sum().backward()
else:
    gather_log_probs(torch.cat(hidden), weight, torch.cat(ids), {CHUNK}).sum().backward()
if device == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - begin
peak = torch.cuda.max_memory_allocated() // 1024 if device == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
torch.save(weight.grad.float().cpu(), "/tmp/bench_loss_head_{variant}_{dtype}.pt")
print(json.dumps({{"peak_mb": (peak - before) / 1024, "seconds": seconds}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import torch

    head_mb = VOCAB * args.hidden / 2**20
    print(f"== loss head gradient: V = {VOCAB}, H = {args.hidden}, {args.sequences} sequences x {args.tokens} response rows,"
          f" |U| = {SUPPORT}, chunk = {CHUNK}, {args.device}; [V, H] is {4 * head_mb:.0f} MB in fp32, {2 * head_mb:.0f} MB in bf16")
    print("| weights | before: peak MB | after: peak MB | before s | after s | max |grad difference| / max |grad| |")
    print("|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        before = measure("before", dtype, args.hidden, args.sequences, args.tokens, args.device)
        after = measure("after", dtype, args.hidden, args.sequences, args.tokens, args.device)
        old = torch.load(f"/tmp/bench_loss_head_before_{dtype}.pt")
        new = torch.load(f"/tmp/bench_loss_head_after_{dtype}.pt")
        difference = float((old - new).abs().max() / old.abs().max())
        print(f"| {dtype} | {before['peak_mb']:.0f} | {after['peak_mb']:.0f} | {before['seconds']:.2f} | {after['seconds']:.2f} | {difference:.1e} |")
        print(f"RESULT {dtype}: peak {before['peak_mb']:.0f} -> {after['peak_mb']:.0f} MB"
              f" ({before['peak_mb'] / after['peak_mb']:.2f}x), {before['seconds']:.2f} -> {after['seconds']:.2f} s")


if __name__ == "__main__":
    main()
