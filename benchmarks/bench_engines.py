"""Rollout and teacher throughput: the vLLM engines against the transformers backends, same prompts.

A batch of the tiny job's shape (P prompts x n responses, 128 px images, CDPruner at
25%) goes through `engines/transformers/rollout.rollout` / `engines/transformers/teacher.teacher_scores` (transformers) and
`vllm_rollout` / `vllm_teacher_scores` (vLLM with our pruning plugin). Figures are
generated (rollout) or scored (teacher) response tokens per second, after one
warm-up batch, best of --repeats; vLLM / transformers ratios side by side.

    python benchmarks/bench_engines.py [--families qwen3_vl qwen3_5] [--prompts 8] [--n 4] [--tokens 32]

On CPU the Qwen3.5 family runs in vLLM only in bf16; its transformers rows are
given in fp32 (what the tiny job uses) and bf16.
"""

from __future__ import annotations

import argparse

import torch

from lt_opd_ray.core.selectors import build_selector
from lt_opd_ray.engines.transformers.rollout import rollout
from lt_opd_ray.engines.transformers.teacher import teacher_scores
from lt_opd_ray.engines.vllm.engine import VLLMEngine
from lt_opd_ray.engines.vllm.roles import vllm_rollout, vllm_teacher_scores
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.loading import compute_precision, load_vlm
from lt_opd_ray.models.processor import VLMProcessor, encode_samples
from lt_opd_ray.models.sampler import SamplingParams
from lt_opd_ray.models.tiny import tiny_model_dir
from lt_opd_ray.sources.synthetic import synthetic_sample
from timing import best_of

BUDGET_BPS, K_MIN, TOP_K = 2500, 2, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["qwen3_vl", "qwen3_5"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    params = SamplingParams(max_new_tokens=args.tokens, top_k_logprobs=TOP_K, stop=())
    samples = [synthetic_sample(i) for i in range(args.prompts)]
    uids = [s.uid for s in samples]
    print(f"{args.prompts} prompts x {args.n} responses, {args.tokens} new tokens, CDPruner at {BUDGET_BPS / 100:.0f}%,"
          f" {torch.get_num_threads()} threads")
    print(f"{'family':<11} {'engine':<22} {'rollout tok/s':>14} {'teacher tok/s':>14}")
    for family in args.families:
        model_dir = tiny_model_dir(family)
        processor = VLMProcessor(model_dir)
        prompts = encode_samples(processor, samples)
        images = [list(s.images) for s in samples]
        engine_dtype = "bfloat16" if family == "qwen3_5" else "float32"
        engine = VLLMEngine(model_dir, dtype=engine_dtype, max_model_len=1024, max_logprobs=TOP_K + 1)
        seconds, rollouts = best_of(args.repeats, lambda: vllm_rollout(
            engine, prompts, images, uids, "cdpruner", BUDGET_BPS, K_MIN, params, args.n, 0, 1))
        tokens = sum(r.response_ids.numel() for r in rollouts)
        vllm_rollout_rate = tokens / seconds
        scored_tokens = tokens
        seconds, _ = best_of(args.repeats, lambda: vllm_teacher_scores(engine, prompts, images, rollouts, TOP_K))
        vllm_teacher_rate = scored_tokens / seconds
        print(f"{family:<11} {'vllm ' + engine_dtype:<22} {vllm_rollout_rate:>14.0f} {vllm_teacher_rate:>14.0f}")
        engine = None  # let the engine go before the transformers copies load

        for dtype in (["float32", "bfloat16"] if family == "qwen3_5" else ["float32"]):
            vlm = QwenVLM(load_vlm(str(model_dir))[1].eval())
            selector = build_selector("cdpruner")

            def hf_rollout():
                with compute_precision(dtype, vlm.device):
                    return rollout(vlm, processor.tokenizer, prompts, uids, selector, BUDGET_BPS, K_MIN, params, args.n, 0, 1)

            seconds, hf_rollouts = best_of(args.repeats, hf_rollout)
            rollout_rate = sum(r.response_ids.numel() for r in hf_rollouts) / seconds

            def hf_teacher():
                with compute_precision(dtype, vlm.device):
                    return teacher_scores(vlm, prompts, rollouts, TOP_K, chunk_size=256)

            seconds, _ = best_of(args.repeats, hf_teacher)
            teacher_rate = scored_tokens / seconds
            print(f"{family:<11} {'transformers ' + dtype:<22} {rollout_rate:>14.0f} {teacher_rate:>14.0f}"
                  f"   vllm/this: rollout {vllm_rollout_rate / rollout_rate:.1f}x, teacher {vllm_teacher_rate / teacher_rate:.1f}x")


if __name__ == "__main__":
    main()
