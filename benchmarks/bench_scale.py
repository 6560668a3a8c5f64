"""The main job's shapes on CPU: learner memory against the micro-batch budget, teacher payload size,
weight sync before/after, and the per-phase seconds of one update of the paper-shaped job.

    python benchmarks/bench_scale.py            # everything (~10 minutes on 2 cores)
    python benchmarks/bench_scale.py --small    # the same code on the tiny model, in seconds (CI)
    python benchmarks/bench_scale.py --parts memory,payload

Model: the narrow random Qwen3.5 of `jobs/train_qwen35_shape.yaml` (hidden 64, 4 layers) with the real
vocabulary (248,320), 896x832 images (728 visual tokens, 37 kept at 5%), responses of 1,024 tokens.

- memory: peak resident memory (sampled every 5 ms) of one learner rank's forward/backward over its
  share, in micro-batches of two token budgets, for a share of 1 and of 2 prompts (8 and 16 rollouts).
  Each configuration runs in a fresh process; the figure is the peak above the resident memory just
  before the step. It must follow the budget, not the share.
- payload: bytes per scored position of the teacher's top-100 payload, fp32 and fp16 values.
- sync: one weight broadcast over a real gloo group, before (fp32 into a transformers copy, then the
  vLLM engine reloaded from it, as the rollout worker did) and after (the compute dtype, bf16, streamed
  into the vLLM engine's own parameters): bytes, seconds, and the receiver's extra copy of the model.
- job: one update of the paper-shaped job through the distributed driver, per phase.
- split: the tiny job's step-time split (benchmarks/bench_runtime.py) at `--before` (a git revision,
  default: the last commit before micro-batches) and in this working tree, one after the other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

SHAPE_JOB = "jobs/train_qwen35_shape.yaml"


# ---------------------------------------------------------------- learner memory
def synthetic_share(model_dir: str, prompts: int, n: int, response_tokens: int, top_k: int, budget_bps: int, k_min: int):
    """(prompts by index, rollouts, teacher scores) of one rank: sampled-looking ids, valid top-k log-probs."""
    import torch

    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.core.wire import Rollout, TeacherScore, token_ids32
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples
    from lt_opd_ray.sources.resolve import load_samples

    job_data = "synthetic:4@896x832" if "vocab" in model_dir else "synthetic:4"
    processor = VLMProcessor(model_dir, max_pixels=1003520)
    samples = load_samples(job_data)[:prompts]
    encoded = dict(enumerate(encode_samples(processor, samples)))
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["text_config"]["vocab_size"]
    rollouts, scores = [], []
    for index, prompt in encoded.items():
        visual = int((prompt.mm_token_type_ids == 1).sum())
        kept = torch.randperm(visual, generator=g)[: tokens_to_keep(visual, budget_bps, k_min)].sort().values
        for _ in range(n):
            ids = torch.randint(0, vocab, (response_tokens,), generator=g)
            rollouts.append(Rollout(index, ids, torch.full((response_tokens,), -12.0), token_ids32(torch.randint(0, vocab, (response_tokens, top_k), generator=g)),
                                    [kept], budget_bps, "length"))
            top = torch.log_softmax(torch.randn(response_tokens, top_k + 1, generator=g), -1) - 3.0  # < 0, mass < 1
            scores.append(TeacherScore(torch.randint(0, vocab, (response_tokens, top_k), generator=g).to(torch.int32), top[:, :top_k],
                                       torch.log_softmax(torch.randn(response_tokens, top_k + 1, generator=g), -1) - 3.0))
    return encoded, rollouts, scores


def learner_step_memory(model_path: str, prompts: int, budget: int, response_tokens: int, top_k: int, chunk: int) -> dict:
    """One rank's micro-batched forward/backward (the learner's own code path, without DeepSpeed); runs in a child."""
    import ctypes

    import psutil
    import torch

    from lt_opd_ray.config.objective import ObjectiveConfig
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.loss import student_loss
    from lt_opd_ray.runtime.micro_batch_stream import MicroBatchStream, StreamedGroup
    from lt_opd_ray.sources.resolve import resolve_model_dir

    torch.set_num_threads(2)
    model_dir, model = load_vlm(resolve_model_dir(model_path), device="cpu")
    vlm = QwenVLM(model.train())
    encoded, rollouts, scores = synthetic_share(str(model_dir), prompts, 8, response_tokens, top_k, 500, 32 if "vocab" in model_path else 2)
    objective = ObjectiveConfig(top_k=top_k, logsoftmax_chunk=chunk)
    groups = [StreamedGroup([r for r in rollouts if r.prompt_index == p], lambda: []) for p in encoded]  # packing only: no scores read
    stream = MicroBatchStream(iter(groups), lambda indices: [encoded[i] for i in indices], budget, False, dict.fromkeys(encoded, 0), packed=True)
    micro = [batch for _, batch in stream if batch is not None]  # the learner's own micro-batches (packed rows, its default)
    process, peak, running = psutil.Process(), [0], [True]

    def sample_rss():
        while running[0]:
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.005)

    before = process.memory_info().rss
    watcher = threading.Thread(target=sample_rss, daemon=True)
    watcher.start()
    begin = time.perf_counter()
    release = ctypes.CDLL("libc.so.6").malloc_trim  # hand freed heap back to the OS, so RSS tracks live memory
    for batch in micro:
        loss, _ = student_loss(vlm, encoded, [rollouts[i] for i in batch.sequences], [scores[i] for i in batch.sequences], objective, len(rollouts),
                               packed=True)
        loss.backward()
        del loss
        release(0)
    seconds = time.perf_counter() - begin
    running[0] = False
    watcher.join()
    return {"sequences": len(rollouts), "micro_batches": len(micro), "computed_tokens": max(b.computed_tokens for b in micro),
            "peak_mb": (peak[0] - before) / 2**20, "seconds": seconds}


def memory_part(small: bool) -> None:
    model, response, top_k, chunk = ("tiny:qwen3_5", 64, 16, 64) if small else ("tiny:qwen3_5-vocab248320", 1024, 100, 256)
    budgets = (256, 1024) if small else (2304, 9216)  # ~2 and ~8 of the ~1,100-token sequences
    print(f"== learner rank, one update's forward/backward ({model}, responses of {response} tokens, top-{top_k}, log-softmax chunk {chunk})")
    print(f"{'budget':>8} {'prompts':>8} {'sequences':>10} {'micro-batches':>14} {'largest computed':>16} {'peak MB':>9} {'seconds':>8}")
    rows = {}
    for budget in budgets:
        for prompts in (1, 2):
            child = json.dumps([model, prompts, budget, response, top_k, chunk])
            out = subprocess.run([sys.executable, __file__, "--learner-child", child], capture_output=True, text=True, check=True)
            row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[7:])
            rows[budget, prompts] = row
            print(f"{budget:>8} {prompts:>8} {row['sequences']:>10} {row['micro_batches']:>14} {row['computed_tokens']:>16}"
                  f" {row['peak_mb']:>9.0f} {row['seconds']:>8.1f}")
    small_b, large_b = budgets
    print(f"RESULT learner peak: 2x the share at the same budget = {rows[large_b, 2]['peak_mb'] / rows[large_b, 1]['peak_mb']:.2f}x"
          f" (budget {large_b}), {rows[small_b, 2]['peak_mb'] / rows[small_b, 1]['peak_mb']:.2f}x (budget {small_b});"
          f" 4x the budget = {rows[large_b, 2]['peak_mb'] / rows[small_b, 2]['peak_mb']:.2f}x (2 prompts)")


# ---------------------------------------------------------------- teacher payload
def payload_part() -> None:
    import torch

    from lt_opd_ray.core.wire import TeacherScore, pack_scores

    positions, k = 1024, 100
    logp = torch.log_softmax(torch.randn(positions, 248320 // 64), -1)  # any valid rows
    top = logp.topk(k, -1)
    scores = [TeacherScore(top.indices.to(torch.int32), top.values, logp[:, : k + 1])] * 8
    print(f"== teacher payload at top-{k} (+ {k + 1} requested ids), 8 responses x {positions} positions")
    for dtype in ("float32", "float16"):
        per_token = pack_scores(scores, dtype).bytes_per_token
        print(f"{dtype:>8}: {per_token:7.1f} bytes per scored position (goal <= 1228.8 = 1.2 KiB)")


# ---------------------------------------------------------------- weight sync
def sync_part(small: bool) -> None:
    from lt_opd_ray.engines.vllm.engine import VLLMEngine
    from lt_opd_ray.engines.vllm.job import EngineSink
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.runtime.learner_group import free_port
    from lt_opd_ray.sources.resolve import resolve_model_dir
    from lt_opd_ray.weight_sync.ends import ModuleSink, TensorSource
    from lt_opd_ray.weight_sync.group import SyncGroup, host_store, join_store

    model_path = "tiny:qwen3_5" if small else "tiny:qwen3_5-vocab248320"
    model_dir, learner = load_vlm(resolve_model_dir(model_path), device="cpu")
    named = list(learner.named_parameters())
    engine = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=2048)
    bucket = 16 * 2**20

    def broadcast(dtype: str, receive) -> tuple[int, float]:
        port = free_port()
        store = host_store("127.0.0.1", port, 2, 120)
        sent = {}
        sender = threading.Thread(target=lambda: sent.setdefault("bytes", SyncGroup(store, 0, 2, 0, 120).send(TensorSource(named, dtype), 1, bucket)))
        sender.start()
        group = SyncGroup(join_store("127.0.0.1", port, 120), 1, 2, 0, 120)
        begin = time.perf_counter()
        receive(group)
        seconds = time.perf_counter() - begin
        sender.join()
        return sent["bytes"], seconds

    copy = load_vlm(resolve_model_dir(model_path), device="cpu")[1]  # the old rollout worker's transformers copy
    copy_mb = sum(p.numel() * p.element_size() for p in copy.parameters()) / 2**20

    def before(group):
        group.receive(ModuleSink(copy), 1)
        engine.load_weights(list(copy.state_dict().items()))

    def after(group):
        group.receive(EngineSink(engine), 1)

    for _ in range(2):  # the first round warms both paths
        old_bytes, old_seconds = broadcast("float32", before)
        new_bytes, new_seconds = broadcast("bfloat16", after)
    print(f"== weight sync of {model_path} ({sum(p.numel() for _, p in named) / 1e6:.1f} M parameters) into a vLLM rollout engine, gloo, 16 MB buckets")
    print(f"before: fp32 into a transformers copy, then vLLM reloaded from it: {old_bytes / 2**20:8.1f} MB {old_seconds:6.2f} s,"
          f" + {copy_mb:.0f} MB resident copy")
    print(f"after:  bf16 streamed into vLLM's own parameters:                {new_bytes / 2**20:8.1f} MB {new_seconds:6.2f} s, no copy")
    print(f"RESULT sync bytes after/before = {new_bytes / old_bytes:.2f}x, seconds = {new_seconds / old_seconds:.2f}x")


# ---------------------------------------------------------------- the job
def job_part(small: bool) -> None:
    import ray

    from lt_opd_ray.config.loading import load_job
    from lt_opd_ray.runtime.driver import Driver
    from lt_opd_ray.runtime.launch import init_ray

    job = load_job("jobs/train_tiny.yaml" if small else SHAPE_JOB)
    job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"dir": "runs/bench-scale", "every_steps": 10**6})})
    init_ray(job)
    driver = Driver(job)
    try:
        log = driver.run_step()
    finally:
        driver.shutdown()
        ray.shutdown()
    print(f"== one update of {SHAPE_JOB if not small else 'jobs/train_tiny.yaml'}: {log.sequences} rollouts, {log.tokens} response tokens,"
          f" {log.micro_batches} learner micro-batches (+{log.filler_micro_batches} fillers), {log.vision_forwards} learner vision passes,"
          f" payload {log.payload_bytes_per_token:.0f} B/position, sync {log.sync_bytes / 2**20:.1f} MB")
    print("RESULT phases: " + "  ".join(f"{name} {seconds:.1f}s" for name, seconds in vars(log.phases).items() if name != "busy"))


# ---------------------------------------------------------------- tiny job before / after
def split_part(before: str, steps: int = 4) -> None:
    import os
    import tempfile

    repo = Path(__file__).resolve().parents[1]
    code = f"import bench_runtime; bench_runtime.step_split('jobs/train_tiny.yaml', {steps})"
    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "before"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(old), before], check=True)
        try:
            for label, tree in ((f"before ({before})", old), ("after (this working tree)", repo)):
                env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'benchmarks'}"}  # Ray's workers inherit it
                out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True)
                print(f"== tiny job step split, {label}")
                print("\n".join(line for line in out.stdout.splitlines() if not line.startswith("==")))
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(old)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the tiny model and short responses (seconds; CI)")
    parser.add_argument("--parts", default="memory,payload,sync,job,split", help="comma-separated: memory, payload, sync, job, split")
    parser.add_argument("--before", default="55091b1", help="git revision of the 'before' tiny-job split")
    parser.add_argument("--learner-child", help=argparse.SUPPRESS)  # one memory configuration, in a fresh process
    args = parser.parse_args()
    if args.learner_child:
        print("RESULT", json.dumps(learner_step_memory(*json.loads(args.learner_child))))
        return
    parts = set(args.parts.split(","))
    if "memory" in parts:
        memory_part(args.small)
    if "payload" in parts:
        payload_part()
    if "sync" in parts:
        sync_part(args.small)
    if "job" in parts:
        job_part(args.small)
    if "split" in parts and not args.small:
        split_part(args.before)


if __name__ == "__main__":
    main()
