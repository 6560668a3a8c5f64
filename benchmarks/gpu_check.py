"""What a lent GPU can answer about the main job (jobs/train_qwen35.yaml) in ten minutes, with torch + transformers only
(no vLLM, Ray or DeepSpeed on that machine).

The model is Qwen3.5-4B's layout (`planning/presets.QWEN35_4B`: 32 layers, every 4th full attention, hidden 2560, MLP
9216, vocabulary 248,320, a 24-block vision tower) with random bf16 weights, built on the device inside each arm's own
process (no 9 GB of weights written or carried); the prompt is a synthetic 896 x 832 image at 5% of its visual tokens
(the job's target budget). Each arm runs under its own time limit (--arm-seconds) and appends its figures to --out (JSON
lines) when it ends, so a run cut short keeps what it measured. What each arm stands for, and what it does not:

  learner  one learner micro-batch of the job's `micro_batch_tokens` (10,400: 10 rollouts of ~1,000 tokens on the
           reduced prompt), one packed row, activation checkpointing, forward + loss + backward in bf16 (DeepSpeed's bf16
           module computes so): seconds, peak GB, and where one more micro-batch synchronises with the GPU (CUDA's sync
           debug mode, counted by file and line). Not: ZeRO-2's gradient reduce-scatter, the optimizer step, NCCL.
  varlen   the same micro-batch with a packed row's attention (and fla's delta rule, where fla imports) as one
           variable-length kernel against the per-sequence loop (`models/packing.varlen_kernels`).
  teacher  the transformers teacher (`teacher_scores`): 8 responses of 1,024 tokens sharing one cached full-token
           prompt, response positions per second. Not: Serve's batching across groups, vLLM's teacher.
  sampler  the transformers rollout engine's sampler (`models/sampler.sample`) at the job's sampling settings
           (temperature 1, top-p 1, top-100 log-probs, stop `</answer>`), 16 sequences on the 5% prompt, 256 new tokens:
           generated tokens per second. Not: vLLM, which the job's rollout workers run.

    python benchmarks/gpu_check.py [--out gpu_check.jsonl] [--arm-seconds 150] [--arms learner varlen teacher sampler]

`--small` runs a tiny config on the CPU (how the script is checked here; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ARMS = ("learner", "varlen", "teacher", "sampler")
MICRO_BATCH_TOKENS, ROLLOUTS, BUDGET_BPS, K_MIN, TOP_K, CHUNK = 10_400, 10, 500, 32, 100, 1024
IMAGE = (896, 832)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_of(repeats: int, run) -> float:
    run()  # warm-up (kernel selection, autotuning, the allocator)
    times = []
    for _ in range(repeats):
        synchronize()
        begin = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - begin)
    return min(times)


def write_folder(out_dir: Path, small: bool) -> Path:
    """config.json, tokenizer and image processor of the 4B layout (no weights: each arm builds them on its device)."""
    from transformers import AutoConfig

    from lt_opd_ray.models.tiny import build_tokenizer, image_processor_config, tiny_config
    from lt_opd_ray.planning.presets import QWEN35_4B

    tokenizer = build_tokenizer()
    config = tiny_config("qwen3_5", tokenizer, hidden=64 if small else 2560, head_dim=32 if small else 256, tied=not small)  # 4B ties its head
    if not small:
        text, vision = QWEN35_4B["text_config"], QWEN35_4B["vision_config"]
        whole = {key: value for key, value in config.to_dict().items() if key != "model_type"}
        config = AutoConfig.for_model("qwen3_5", **{**whole, "text_config": {**config.text_config.to_dict(), **text},
                                                    "vision_config": {**config.vision_config.to_dict(), **vision}})
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    bounds = dict(min_pixels=128 * 128, max_pixels=128 * 128) if small else dict(min_pixels=3136, max_pixels=1003520)  # the job's
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_processor_config("qwen3_5", **bounds), indent=2))
    return out_dir


def random_model(model_dir: Path, device: str):
    """The folder's model with random bf16 weights, made on `device`, in training mode (QwenVLM over it)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.patch_embedding import patches_as_matmul

    config = AutoConfig.from_pretrained(model_dir)
    for part in (config, config.text_config, config.vision_config):
        part.initializer_range = 0.02
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    patches_as_matmul(model)  # as models/loading.load_vlm sets it up
    return QwenVLM(model)


def prompt_and_rollouts(model_dir: Path, rollouts: int, tokens: int, small: bool):
    """The 5% prompt and `rollouts` random rollouts of `tokens` response tokens with random teacher scores."""
    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.core.wire import Rollout, TeacherScore
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples
    from lt_opd_ray.sources.synthetic import synthetic_sample

    processor = VLMProcessor(model_dir)
    prompt = encode_samples(processor, [synthetic_sample(0, size=128 if small else IMAGE)])[0]
    vocab = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    n_visual = int(prompt.image_grid_thw[0].prod()) // 4
    kept = torch.randperm(n_visual, generator=torch.Generator().manual_seed(1))[: tokens_to_keep(n_visual, BUDGET_BPS, K_MIN)].sort().values
    g = torch.Generator().manual_seed(0)
    made, scores = [], []
    for _ in range(rollouts):
        ids = torch.randint(0, vocab, (tokens,), generator=g)
        top = torch.randint(0, vocab, (tokens, TOP_K), generator=g).to(torch.int32)
        made.append(Rollout(0, ids, torch.full((tokens,), -2.0), top, [kept], BUDGET_BPS, "stop"))
        scores.append(TeacherScore(torch.randint(0, vocab, (tokens, TOP_K), generator=g).to(torch.int32),
                                   -torch.rand(tokens, TOP_K, generator=g) * 5, -torch.rand(tokens, TOP_K + 1, generator=g) * 5))
    return processor, prompt, made, scores


def micro_batch(model_dir: Path, device: str, small: bool):
    """The learner's micro-batch as a step function: packed, checkpointed, forward + loss + backward; and its response
    tokens. Its rows fill the job's token budget: each rollout's reduced prompt and response."""
    from lt_opd_ray.config.objective import ObjectiveConfig
    from lt_opd_ray.models.loss import reduced_length, student_loss
    from lt_opd_ray.models.packing import use_packed_attention

    vlm = random_model(model_dir, device)
    vlm.model.train()
    vlm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_packed_attention(vlm.model)
    _, prompt, (one,), _ = prompt_and_rollouts(model_dir, 1, 1, small)
    budget = 640 if small else MICRO_BATCH_TOKENS
    tokens = max(budget // ROLLOUTS - reduced_length(prompt, one.selected), 8)
    _, prompt, rollouts, scores = prompt_and_rollouts(model_dir, ROLLOUTS, tokens, small)
    objective = ObjectiveConfig(top_k=TOP_K, logsoftmax_chunk=CHUNK)

    def step():
        vlm.model.zero_grad(set_to_none=True)
        loss, _ = student_loss(vlm, {0: prompt}, rollouts, scores, objective, packed=True)
        loss.backward()

    return step, ROLLOUTS * tokens


def peak_gb(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def learner_arm(model_dir: Path, device: str, small: bool) -> dict:
    step, tokens = micro_batch(model_dir, device, small)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = best_of(2, step)
    return {"seconds": seconds, "response_tokens": tokens, "tokens_per_s": tokens / seconds, "peak_gb": peak_gb(device),
            "syncs": synchronizing_calls(step) if device == "cuda" else None}


def synchronizing_calls(step) -> dict[str, int]:
    """Where one more micro-batch makes the host wait for the GPU: CUDA's sync debug mode warns at each synchronizing
    call; the warnings counted by the innermost frame of this package or of transformers (tests/device_reads.py is
    this count's CPU stand-in)."""
    import collections
    import traceback
    import warnings

    places = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "/lt_opd_ray/" in f.filename or "/transformers/" in f.filename]
        where = frames[-1] if frames else None
        places[f"{where.filename.rsplit('/', 2)[-2]}/{where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where else "?"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning after
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return dict(places.most_common())


def varlen_arm(model_dir: Path, device: str, small: bool) -> dict:
    from lt_opd_ray.models import packing

    step, tokens = micro_batch(model_dir, device, small)
    kernels = sorted(packing.varlen_kernels(torch.device(device), torch.bfloat16))
    fused = best_of(2, step)
    found = packing.varlen_kernels
    packing.varlen_kernels = lambda device, dtype: frozenset()  # the per-sequence fallback
    try:
        looped = best_of(2, step)
    finally:
        packing.varlen_kernels = found
    return {"varlen_kernels": kernels, "varlen_seconds": fused, "loop_seconds": looped, "loop_over_varlen": looped / fused}


def teacher_arm(model_dir: Path, device: str, small: bool) -> dict:
    from lt_opd_ray.engines.transformers.teacher import teacher_scores

    vlm = random_model(model_dir, device)
    vlm.model.eval().requires_grad_(False)
    tokens = 32 if small else 1024
    _, prompt, rollouts, _ = prompt_and_rollouts(model_dir, 8, tokens, small)

    def score():
        with torch.no_grad():
            teacher_scores(vlm, {0: prompt}, rollouts, TOP_K, CHUNK)

    seconds = best_of(2, score)
    return {"seconds": seconds, "positions_per_s": 8 * tokens / seconds, "peak_gb": peak_gb(device)}


def sampler_arm(model_dir: Path, device: str, small: bool) -> dict:
    from lt_opd_ray.models.sampler import SamplingParams, sample

    vlm = random_model(model_dir, device)
    vlm.model.eval().requires_grad_(False)
    processor, prompt, rollouts, _ = prompt_and_rollouts(model_dir, 1, 1, small)
    reduced = vlm.reduce(prompt, vlm.visual_features(prompt), rollouts[0].selected)
    sequences, new_tokens = (4, 16) if small else (16, 256)
    params = SamplingParams(max_new_tokens=new_tokens, top_k_logprobs=TOP_K, stop=("</answer>",), eos_token_ids=processor.eos_token_ids)
    completions = []

    def run():
        with torch.no_grad():
            completions[:] = sample(vlm, [reduced] * sequences, params, list(range(sequences)), processor.tokenizer)

    seconds = best_of(1, run)
    generated = sum(c.token_ids.numel() for c in completions)
    return {"seconds": seconds, "sequences": sequences, "tokens": generated, "tokens_per_s": generated / seconds}


def child(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    arm = {"learner": learner_arm, "varlen": varlen_arm, "teacher": teacher_arm, "sampler": sampler_arm}[args.arm]
    with torch.no_grad() if args.arm in ("teacher", "sampler") else torch.enable_grad():
        print(json.dumps(arm(Path(args.model), args.device, args.small)))


def run_arm(arm: str, model: Path, args) -> dict:
    """One arm in its own process under its time limit: its figures, or why it has none."""
    command = [sys.executable, __file__, "--arm", arm, "--model", str(model), "--device", args.device, *(["--small"] if args.small else [])]
    begin = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.arm_seconds)
    except subprocess.TimeoutExpired:
        return {"arm": arm, "error": f"no answer in {args.arm_seconds} s"}
    if done.returncode:
        return {"arm": arm, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
                "stderr_tail": done.stderr[-2000:]}
    return {"arm": arm, "wall_s": time.perf_counter() - begin, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.jsonl", help="JSON lines, one per arm, appended as each ends")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--arm-seconds", type=int, default=150)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        return child(args)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"== {where}, torch {torch.__version__}; Qwen3.5-4B layout{' (small)' if args.small else ''}, random bf16 weights", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_folder(Path(tmp), args.small)
        for arm in args.arms:
            result = run_arm(arm, model, args)
            with open(args.out, "a") as out:
                out.write(json.dumps({"device": where, "small": args.small, **result}) + "\n")
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
