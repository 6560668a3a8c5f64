"""A frozen role's weights in fp32 (cast to bf16 by autocast on every op) against weights held in bf16.

The teacher and the transformers rollout engine compute in bf16 under a bf16 job. Autocast keeps a cast copy only of
weights that require grad, so a frozen model holding fp32 weights is cast again on every matmul of every forward and
holds twice the bytes. Both ways run here on the same random Qwen3.5 (the tiny recipe, wider), the same prompts and
rollouts, side by side: rollout tokens/s (`engines/transformers/rollout.rollout`), teacher scored tokens/s
(`engines/transformers/teacher.teacher_scores`), the weights' bytes.

    python benchmarks/bench_frozen_dtype.py [--hidden 512] [--prompts 4] [--n 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from lt_opd_ray.core.selectors import build_selector
from lt_opd_ray.engines.transformers.rollout import rollout
from lt_opd_ray.engines.transformers.teacher import teacher_scores
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.loading import compute_precision, load_vlm
from lt_opd_ray.models.processor import VLMProcessor, encode_samples
from lt_opd_ray.models.sampler import SamplingParams
from lt_opd_ray.models.tiny import build_tiny_model
from lt_opd_ray.sources.synthetic import synthetic_sample
from timing import best_of

BUDGET_BPS, K_MIN, TOP_K = 2500, 2, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model_dir = build_tiny_model("qwen3_5", folder, hidden=args.hidden)
        processor = VLMProcessor(model_dir)
        samples = [synthetic_sample(i) for i in range(args.prompts)]
        prompts = encode_samples(processor, samples)
        params = SamplingParams(max_new_tokens=args.tokens, top_k_logprobs=TOP_K, stop=())
        selector = build_selector("cdpruner")
        rows, rollouts = {}, None
        for held in ("float32", "bfloat16"):
            vlm = QwenVLM(load_vlm(str(model_dir), device="cpu", dtype=held)[1].eval().requires_grad_(False))

            def sample(vlm=vlm):
                with compute_precision("bfloat16", vlm.device):
                    return rollout(vlm, processor.tokenizer, prompts, [s.uid for s in samples], selector, BUDGET_BPS, K_MIN, params, args.n, 0, 1)

            seconds, sampled = best_of(args.repeats, sample)
            rollouts = rollouts or sampled  # the teacher scores the same rollouts both ways
            tokens = sum(r.response_ids.numel() for r in rollouts)

            def score(vlm=vlm):
                with compute_precision("bfloat16", vlm.device):
                    return teacher_scores(vlm, prompts, rollouts, TOP_K, chunk_size=256)

            teacher_seconds, _ = best_of(args.repeats, score)
            weight_mb = sum(p.numel() * p.element_size() for p in vlm.model.parameters()) / 2**20
            rows[held] = (sum(r.response_ids.numel() for r in sampled) / seconds, tokens / teacher_seconds, weight_mb)
    print(f"Qwen3.5 recipe at hidden {args.hidden}; {args.prompts} prompts x {args.n} responses of {args.tokens} tokens; bf16 autocast;"
          f" {torch.get_num_threads()} threads; best of {args.repeats}")
    print(f"{'weights held in':<16} {'rollout tok/s':>14} {'teacher tok/s':>14} {'weights MB':>11}")
    for held, (rollout_rate, teacher_rate, weight_mb) in rows.items():
        print(f"{held:<16} {rollout_rate:>14.0f} {teacher_rate:>14.0f} {weight_mb:>11.1f}")
    (r32, t32, m32), (r16, t16, m16) = rows["float32"], rows["bfloat16"]
    print(f"bf16 / fp32: rollout {r16 / r32:.2f}x, teacher {t16 / t32:.2f}x, weights {m16 / m32:.2f}x")


if __name__ == "__main__":
    main()
