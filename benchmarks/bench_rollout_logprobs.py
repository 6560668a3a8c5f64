"""What a rollout's log-probs cost vLLM: the engine's own rollout call with a stop string and top-k log-probs, with
vLLM decoding every log-prob entry to text (what it does when `detokenize` is on for the stop string, the engine
before `loop.undecoded_logprobs`) against the engine as it is; and the other arms a job asks for.

    python benchmarks/bench_rollout_logprobs.py [--family qwen3_vl] [--prompts 8] [--n 4] [--tokens 64] [--top-k 100]

Arms (generated tokens per second of `vllm_rollout`, best of --repeats after a warm-up, one engine):
  decoded        stop string, top-k log-probs, each entry decoded (the engine before this change)
  undecoded      stop string, top-k log-probs, entries left as ids (the LT-OPD rollout now)
  sampled only   stop string, the sampled token's log-prob only (the RL modes without a KL term now)
  no stop        no stop string, top-k (no detokenization at all: the ceiling)
The responses of `decoded` and `undecoded` are the same tokens (checked): the stop string keeps its meaning.
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from lt_opd_ray.engines.vllm import loop
from lt_opd_ray.engines.vllm.engine import VLLMEngine
from lt_opd_ray.engines.vllm.roles import vllm_rollout
from lt_opd_ray.models.processor import VLMProcessor, encode_samples
from lt_opd_ray.models.sampler import SamplingParams
from lt_opd_ray.models.tiny import tiny_model_dir
from lt_opd_ray.sources.synthetic import synthetic_sample
from timing import best_of

BUDGET_BPS, K_MIN, STOP = 2500, 2, ("</answer>",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model_dir = tiny_model_dir(args.family)
    processor = VLMProcessor(model_dir)
    samples = [synthetic_sample(i) for i in range(args.prompts)]
    prompts = encode_samples(processor, samples)
    images = [list(s.images) for s in samples]
    uids = [s.uid for s in samples]
    dtype = "bfloat16" if args.family == "qwen3_5" else "float32"
    engine = VLLMEngine(model_dir, dtype=dtype, max_model_len=1024, max_logprobs=args.top_k + 1)
    eos = processor.eos_token_ids

    def params(top_k: int, stop: tuple[str, ...]) -> SamplingParams:
        return SamplingParams(max_new_tokens=args.tokens, top_k_logprobs=top_k, stop=stop, eos_token_ids=eos)

    def arm(sampling: SamplingParams):
        return best_of(args.repeats, lambda: vllm_rollout(engine, prompts, images, uids, "cdpruner", BUDGET_BPS, K_MIN,
                                                          sampling, args.n, 0, 1))

    with mock.patch.object(loop, "undecoded_logprobs", lambda state: None):  # vLLM left to decode every entry
        decoded = arm(params(args.top_k, STOP))
    arms = {"decoded": decoded, "undecoded": arm(params(args.top_k, STOP)), "sampled only": arm(params(0, STOP)),
            "no stop": arm(params(args.top_k, ()))}
    same = all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(arms["decoded"][1], arms["undecoded"][1]))
    print(f"{args.family}, {args.prompts} prompts x {args.n} responses, up to {args.tokens} new tokens, top-{args.top_k}"
          f" log-probs, stop {list(STOP)}, {torch.get_num_threads()} threads, {engine.runner}")
    print(f"{'arm':<14} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'x decoded':>10}")
    base = None
    for name, (seconds, rollouts) in arms.items():
        tokens = sum(r.response_ids.numel() for r in rollouts)
        rate = tokens / seconds
        base = base or rate
        print(f"{name:<14} {tokens:>7} {seconds:>8.3f} {rate:>8.0f} {rate / base:>9.2f}x")
    print(f"decoded and undecoded sampled the same tokens: {same}")


if __name__ == "__main__":
    main()
