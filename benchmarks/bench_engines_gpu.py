"""GPU: rollout and teacher throughput of vLLM vs transformers on a ~1B random Qwen3.5 of real vocabulary.

Builds a random Qwen3.5 (vocabulary 248,320, hidden 1024, 16 layers: 12 Gated
DeltaNet + 4 full attention, a 12-block vision tower; ~0.9B parameters) in bf16,
896 x 896 images (784 visual tokens each), and reports:

- rollout tokens/s of vLLM (pruning inside the engine) and of the transformers
  backend at 5%, 25% and 100% budgets, ratio side by side;
- teacher scoring tokens/s (vLLM, full tokens, top-k + requested ids) and transformers;
- seconds of one in-place weight update of the vLLM engine from in-memory tensors.

    python benchmarks/bench_engines_gpu.py [--prompts 16] [--n 4] [--tokens 128] [--small]

`--small` shrinks the model and images so the script runs anywhere (it is how the
script is checked on CPU; the figures then mean nothing).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 248_320


def build_model(out_dir: Path, small: bool) -> Path:
    """A random Qwen3.5 VLM folder whose special tokens match our offline tokenizer."""
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.models.tiny import build_tokenizer, image_processor_config, tiny_config

    tokenizer = build_tokenizer()
    config = tiny_config("qwen3_5", tokenizer, hidden=64 if small else 1024, head_dim=32 if small else 128)
    text, vision = config.text_config, config.vision_config
    text.vocab_size = 512 if small else VOCAB
    layers = 4 if small else 16
    text.num_hidden_layers = layers
    text.layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    if not small:
        text.intermediate_size, text.num_attention_heads, text.num_key_value_heads = 3584, 8, 2
        text.linear_num_key_heads, text.linear_num_value_heads = 8, 16
        vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads = 12, 768, 3072, 12
        vision.out_hidden_size = text.hidden_size
    for part in (config, text, vision):
        part.initializer_range = 0.02
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    side = 128 if small else 896
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(image_processor_config("qwen3_5", min_pixels=side * side, max_pixels=side * side), indent=2)
    )
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {side}x{side} images")
    return out_dir


def timed(run) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    begin = time.perf_counter()
    result = run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - begin, result


def main() -> None:
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.engines.transformers.rollout import rollout
    from lt_opd_ray.engines.transformers.teacher import teacher_scores
    from lt_opd_ray.engines.vllm.engine import VLLMEngine
    from lt_opd_ray.engines.vllm.roles import vllm_rollout, vllm_teacher_scores
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.loading import compute_precision
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples
    from lt_opd_ray.models.sampler import SamplingParams
    from lt_opd_ray.sources.synthetic import synthetic_sample

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "qwen35", args.small)
        side = 128 if args.small else 896
        samples = [synthetic_sample(i, size=side) for i in range(args.prompts)]
        processor = VLMProcessor(model_dir)
        prompts = encode_samples(processor, samples)
        images, uids = [list(s.images) for s in samples], [s.uid for s in samples]
        params = SamplingParams(max_new_tokens=args.tokens, top_k_logprobs=args.top_k, stop=())

        engine = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=4096, max_logprobs=args.top_k + 1)
        print(f"{args.prompts} prompts x {args.n} responses, {args.tokens} new tokens, top-{args.top_k}, device {device},"
              f" vLLM runner {'V2' if engine.v2_runner else 'V1'}")
        vllm_rates, last = {}, None
        for budget in (500, 2500, 10000):
            run = lambda: vllm_rollout(engine, prompts, images, uids, "cdpruner", budget, 2, params, args.n, 0, 1)  # noqa: E731
            run()  # warm-up (compilation, CUDA graphs)
            seconds, last = timed(run)
            vllm_rates[budget] = sum(r.response_ids.numel() for r in last) / seconds
        scored = sum(r.response_ids.numel() for r in last)
        vllm_teacher_scores(engine, prompts, images, last[:2], args.top_k)  # warm-up
        seconds, _ = timed(lambda: vllm_teacher_scores(engine, prompts, images, last, args.top_k))
        vllm_teacher_rate = scored / seconds

        vlm = QwenVLM(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).to(device).eval())
        weights = list(vlm.model.state_dict().items())
        engine.load_weights(weights)  # warm-up
        update_seconds, _ = timed(lambda: engine.load_weights(weights))

        selector = build_selector("cdpruner")
        print(f"{'budget':>7} {'vLLM tok/s':>11} {'transformers tok/s':>19} {'ratio':>7}")
        for budget in (500, 2500, 10000):
            def run():
                with compute_precision("bfloat16", device):
                    return rollout(vlm, processor.tokenizer, prompts, uids, selector, budget, 2, params, args.n, 0, 1)

            seconds, hf = timed(run)
            rate = sum(r.response_ids.numel() for r in hf) / seconds
            print(f"{budget / 100:>6.0f}% {vllm_rates[budget]:>11.0f} {rate:>19.0f} {vllm_rates[budget] / rate:>6.1f}x")

        def hf_teacher():
            with compute_precision("bfloat16", device):
                return teacher_scores(vlm, prompts, last, args.top_k, chunk_size=1024)

        seconds, _ = timed(hf_teacher)
        hf_teacher_rate = scored / seconds
        print(f"teacher scoring tok/s: vLLM {vllm_teacher_rate:.0f}, transformers {hf_teacher_rate:.0f}"
              f" ({vllm_teacher_rate / hf_teacher_rate:.1f}x)")
        print(f"weight update (in place, {sum(t.numel() for _, t in weights) / 1e9:.2f}B parameters): {update_seconds:.2f} s")


if __name__ == "__main__":
    main()
