"""GPU check of issue 26's learner and teacher paths, with torch + transformers only (no vLLM, Ray or DeepSpeed).

On a random Qwen3.5 of real vocabulary (hidden 1024, 16 layers: 12 Gated DeltaNet + 4 full attention, bf16)
and 896 x 896 images (784 visual tokens), one process per arm:

1. the learner's micro-batch (`loss.student_loss` forward + backward, 8 rollouts of one prompt at 5%) with
   Qwen3.5's linear-attention kernels (`fla`, `causal_conv1d`, where importable) and with them hidden, so
   transformers runs its reference PyTorch loops;
2. the teacher on transformers (`engines/transformers/teacher.teacher_scores`): response positions per second with the prompt shared
   by its 8 responses (one prefix, as the code runs) and with every response scored alone (its own prefix); and
   with its weights held in bf16 (frozen roles load in the compute dtype) against fp32 cast by autocast on every op;
3. the learner's micro-batch on 8 responses of long-tailed lengths (as `benchmarks/bench_packing.py` draws them,
   mean ~450 of 1,024) in left-padded rows against one packed row (`pools.learner.packing`): seconds and peak memory;
4. the loss head's backward before / after: `benchmarks/bench_loss_head.py --device cuda`.

    python benchmarks/gpu_check.py [--tokens 450] [--small]

`--small` shrinks everything so the script runs on CPU (how it is checked here; the figures then mean nothing).
Carry the kernels as wheels if the machine lacks them: PYTHONPATH=<unpacked fla-core> makes arm 1's first row real.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HIDDEN_KERNELS = "LT_OPD_HIDE_LINEAR_ATTENTION_KERNELS"


def hide_kernels() -> None:
    """Make `fla` and `causal_conv1d` unimportable in this process (before transformers resolves its kernels)."""
    import importlib.abc

    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"fla", "causal_conv1d"}:
                raise ImportError(f"{name} hidden by {HIDDEN_KERNELS}")
            return None

    sys.meta_path.insert(0, Hidden())


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_of(repeats: int, run) -> float:
    run()  # warm-up (kernel compilation, autotuning)
    times = []
    for _ in range(repeats):
        synchronize()
        begin = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - begin)
    return min(times)


def inputs(model_dir: Path, responses: int, tokens: int | list[int], top_k: int):
    """One prompt, its reduced selection at 5%, and `responses` random rollouts (`tokens` each, or each its own of a
    list) with random teacher scores."""
    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.core.wire import Rollout, TeacherScore
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples
    from lt_opd_ray.sources.synthetic import synthetic_sample

    processor = VLMProcessor(model_dir)
    prompt = encode_samples(processor, [synthetic_sample(0)])[0]
    vocab = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    n_visual = int(prompt.image_grid_thw[0].prod()) // 4
    kept = torch.randperm(n_visual)[: tokens_to_keep(n_visual, 500, 32)].sort().values
    generator = torch.Generator().manual_seed(0)
    rollouts, scores = [], []
    for i in range(responses):
        tokens_i = tokens[i] if isinstance(tokens, list) else tokens
        ids = torch.randint(0, vocab, (tokens_i,), generator=generator)
        top = torch.randint(0, vocab, (tokens_i, top_k), generator=generator)
        rollouts.append(Rollout(0, ids, torch.full((tokens_i,), -2.0), top, [kept], 500, "length"))
        scores.append(TeacherScore(torch.randint(0, vocab, (tokens_i, top_k), generator=generator).to(torch.int32),
                                   -torch.rand(tokens_i, top_k, generator=generator) * 5, -torch.rand(tokens_i, top_k + 1, generator=generator) * 5))
    return prompt, rollouts, scores


def learner_arm(model_dir: Path, tokens: int, device: str) -> dict:
    from lt_opd_ray.config.objective import ObjectiveConfig
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.kernels import missing_kernels
    from lt_opd_ray.models.loading import compute_precision, load_vlm
    from lt_opd_ray.models.loss import student_loss

    _, model = load_vlm(str(model_dir), device=device)
    vlm = QwenVLM(model.train())
    prompt, rollouts, scores = inputs(model_dir, 8, tokens, 100)

    def step():
        model.zero_grad(set_to_none=True)
        with compute_precision("bfloat16", device):
            loss, _ = student_loss(vlm, {0: prompt}, rollouts, scores, ObjectiveConfig(top_k=100, logsoftmax_chunk=1024))
        loss.backward()

    seconds = best_of(2, step)
    return {"seconds": seconds, "missing": list(missing_kernels("qwen3_5", on_gpu=True))}


def packing_arm(model_dir: Path, tokens: int, device: str) -> dict:
    """The learner's micro-batch on long-tailed response lengths, padded rows against one packed row."""
    from bench_packing import response_lengths

    from lt_opd_ray.config.objective import ObjectiveConfig
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.loading import compute_precision, load_vlm
    from lt_opd_ray.models.loss import student_loss

    _, model = load_vlm(str(model_dir), device=device)
    vlm = QwenVLM(model.train())
    prompt, rollouts, scores = inputs(model_dir, 8, response_lengths(8, max(tokens * 2, 2)), 100)
    out = {}
    for packed in (False, True):
        def step(packed=packed):
            model.zero_grad(set_to_none=True)
            with compute_precision("bfloat16", device):
                loss, _ = student_loss(vlm, {0: prompt}, rollouts, scores, ObjectiveConfig(top_k=100, logsoftmax_chunk=1024), packed=packed)
            loss.backward()

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out["packed" if packed else "padded"] = {
            "seconds": best_of(2, step), "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0}
    return {**out, "lengths": [r.response_ids.numel() for r in rollouts]}


def teacher_arm(model_dir: Path, tokens: int, device: str) -> dict:
    from lt_opd_ray.engines.transformers.teacher import teacher_scores
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.loading import compute_precision, load_vlm

    prompt, rollouts, _ = inputs(model_dir, 8, tokens, 100)
    positions, rates = 8 * tokens, {}
    for held in ("float32", "bfloat16"):  # weights as the teacher held them before, and as it holds them (frozen: the compute dtype)
        vlm = QwenVLM(load_vlm(str(model_dir), device=device, dtype=held)[1].eval().requires_grad_(False))

        def shared(vlm=vlm):
            with torch.no_grad(), compute_precision("bfloat16", device):
                teacher_scores(vlm, {0: prompt}, rollouts, 100, 1024)

        def alone(vlm=vlm):
            with torch.no_grad(), compute_precision("bfloat16", device):
                for r in rollouts:
                    teacher_scores(vlm, {0: prompt}, [r], 100, 1024)

        rates[held] = {"shared": positions / best_of(2, shared), "alone": positions / best_of(2, alone)}
        del vlm
    return {**rates["bfloat16"], "fp32 weights": rates["float32"]["shared"]}


def child(args) -> None:
    if os.environ.get(HIDDEN_KERNELS):
        hide_kernels()
    sys.path.insert(0, str(Path(__file__).parent))
    arm = {"learner": learner_arm, "packing": packing_arm, "teacher": teacher_arm}[args.arm]
    print(json.dumps(arm(Path(args.model), args.tokens, args.device)))


def run_child(arm: str, model: Path, args, hidden: bool) -> dict:
    env = {**os.environ, **({HIDDEN_KERNELS: "1"} if hidden else {})}
    command = [sys.executable, __file__, "--arm", arm, "--model", str(model), "--tokens", str(args.tokens), "--device", args.device]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{arm} arm failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=450, help="response tokens per rollout")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arm", choices=["learner", "packing", "teacher"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        return child(args)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engines_gpu import build_model  # the same random Qwen3.5 as the vLLM benchmark

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.small)
        print(f"== device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}), {args.tokens} response tokens x 8 rollouts of one prompt")
        print("| learner micro-batch (fwd + bwd) | missing kernels | seconds |")
        print("|---|---|---|")
        for hidden in (False, True):
            result = run_child("learner", model, args, hidden)
            print(f"| {'kernels hidden' if hidden else 'as installed'} | {', '.join(result['missing']) or 'none'} | {result['seconds']:.3f} |")
        packing = run_child("packing", model, args, False)
        padded, packed = packing["padded"], packing["packed"]
        print(f"learner micro-batch, response lengths {sorted(packing['lengths'])}: padded rows {padded['seconds']:.3f} s,"
              f" {padded['peak_gb']:.2f} GB peak; one packed row {packed['seconds']:.3f} s, {packed['peak_gb']:.2f} GB peak"
              f" ({packed['seconds'] / padded['seconds']:.2f}x the seconds)")
        teacher = run_child("teacher", model, args, False)
        print(f"teacher (transformers) response positions/s: prompt shared by its 8 responses {teacher['shared']:.0f},"
              f" each response alone {teacher['alone']:.0f} ({teacher['shared'] / teacher['alone']:.2f}x);"
              f" weights held in bf16 against fp32 under autocast: {teacher['shared']:.0f} / {teacher['fp32 weights']:.0f}"
              f" ({teacher['shared'] / teacher['fp32 weights']:.2f}x)")
    loss_args = ["--hidden", "64", "--sequences", "2", "--tokens", "16"] if args.small else ["--hidden", "2560", "--sequences", "8", "--tokens", "450"]
    subprocess.run([sys.executable, str(Path(__file__).parent / "bench_loss_head.py"), "--device", args.device, *loss_args], check=True)


if __name__ == "__main__":
    main()
