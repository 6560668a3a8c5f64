"""Rollout engine occupancy: one group at a time against every queued group in one engine, in one run.

A rollout worker is handed its share of an update as groups (one prompt x n responses
each). Before, it sampled them one after another, so vLLM decoded n sequences at a
time; now every group it holds runs in one continuously batched engine
(`engines/vllm/loop.py`, `pools.rollout.engine_groups`).

Part 1 (engine): one VLLMEngine (vLLM's CPU build, tiny Qwen3.5 in bf16) gets G groups
x n sequences, sampled one group at a time and then from G threads at once. Occupancy
is, averaged over the engine's steps, the sequences the step ran over what the engine's
limits allow at that moment: min(max_num_seqs, the worker's sequences not yet finished).

Part 2 (jobs): seconds per update of a job with `pools.rollout.engine_groups` 1 and its
default, through the real system (Ray, Serve, DeepSpeed), same data and seed; the first
update of each is warm-up. Default: the tiny vLLM job; `--shape` adds the paper-shaped
job with vLLM rollouts (bf16, the transformers teacher: vLLM's CPU runner cannot score
a 248,320-id vocabulary).

    python benchmarks/bench_rollout_occupancy.py [--groups 8] [--n 8] [--tokens 64] [--updates 3] [--shape | --shape-only]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import ray

from lt_opd_ray.config.loading import load_job


def occupancy(records, total: int, max_num_seqs: int) -> float:
    """Mean over steps of ran / min(max_num_seqs, sequences of the worker not yet finished before the step)."""
    shares, finished = [], 0
    for record in records:
        shares.append(record.ran / min(max_num_seqs, total - finished))
        finished += record.finished
    return statistics.mean(shares)


def engine_part(groups: int, n: int, tokens: int) -> None:
    from lt_opd_ray.engines.vllm.engine import VLLMEngine, engine_prompt
    from lt_opd_ray.engines.vllm.selection import SelectionRequest
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples
    from lt_opd_ray.models.sampler import SamplingParams
    from lt_opd_ray.models.tiny import tiny_model_dir
    from lt_opd_ray.sources.synthetic import synthetic_sample

    model_dir = tiny_model_dir("qwen3_5")
    engine = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=2048)
    max_num_seqs = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    samples = [synthetic_sample(i) for i in range(groups)]
    prompts = encode_samples(VLMProcessor(model_dir), samples)
    params = SamplingParams(max_new_tokens=tokens, top_k_logprobs=16, stop=())
    calls = [([engine_prompt(p, list(s.images))] * n, [SelectionRequest(budget_bps=2500, k_min=2, seed=g)] * n, list(range(g * n, (g + 1) * n)))
             for g, (p, s) in enumerate(zip(prompts, samples))]
    engine.generate(*calls[0][:2], params, calls[0][2])  # warm-up

    def one_at_a_time():
        for prompts_, selections, seeds in calls:
            engine.generate(prompts_, selections, params, seeds)

    def all_at_once():
        threads = [threading.Thread(target=engine.generate, args=(p, s, params, seeds)) for p, s, seeds in calls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    print(f"== engine: {groups} groups x {n} sequences, {tokens} new tokens each, tiny Qwen3.5 bf16, vLLM CPU build,"
          f" max_num_seqs {max_num_seqs}")
    print("| schedule | seconds | engine steps | sequences per step (mean) | occupancy of what the limits allow |")
    print("|---|---|---|---|---|")
    results = {}
    for label, run in (("one group at a time (engine_groups 1)", one_at_a_time), (f"all groups in the engine (engine_groups >= {groups})", all_at_once)):
        begin = time.perf_counter()
        run()
        seconds = time.perf_counter() - begin
        records = engine.loop.steps_since(begin)
        results[label] = seconds
        print(f"| {label} | {seconds:.2f} | {len(records)} | {statistics.mean(r.ran for r in records):.1f}"
              f" | {occupancy(records, groups * n, max_num_seqs):.1%} |")
    before, after = results.values()
    print(f"RESULT engine: {before:.2f} s -> {after:.2f} s ({before / after:.2f}x)")


def job_seconds(path: str, overrides: list[str], updates: int) -> tuple[float, list[float]]:
    from lt_opd_ray.runtime.driver import Driver
    from lt_opd_ray.runtime.launch import init_ray

    job = load_job(path, overrides + ["checkpoint.dir=runs/bench-occupancy", "checkpoint.every_steps=1000000"])
    init_ray(job)
    driver = Driver(job)
    try:
        steps = [driver.run_step().phases.step for _ in range(updates)]
    finally:
        driver.shutdown()
        ray.shutdown()
    return statistics.mean(steps[1:]) if len(steps) > 1 else steps[0], steps


def job_part(label: str, path: str, overrides: list[str], updates: int) -> None:
    print(f"== job: {label} ({path} {' '.join(overrides)}), {updates} updates, the first is warm-up")
    print("| engine_groups | seconds per update (after warm-up) | every update |")
    print("|---|---|---|")
    means = []
    for groups in (1, 32):
        mean, steps = job_seconds(path, overrides + [f"pools.rollout.engine_groups={groups}"], updates)
        means.append(mean)
        print(f"| {groups} | {mean:.2f} | {' '.join(f'{s:.2f}' for s in steps)} |")
    print(f"RESULT {label}: {means[0]:.2f} -> {means[1]:.2f} s/update ({means[0] / means[1]:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--shape", action="store_true", help="also the paper-shaped job with vLLM rollouts (slow: minutes per update)")
    parser.add_argument("--shape-only", action="store_true", help="only the paper-shaped job")
    parser.add_argument("--engine-only", action="store_true")
    args = parser.parse_args()
    if not args.shape_only:
        engine_part(args.groups, args.n, args.tokens)
        if args.engine_only:
            return
        job_part("tiny vLLM job", "jobs/train_tiny_vllm.yaml", ["sampling.prompts_per_step=8", "sampling.n=4"], args.updates)
    if args.shape or args.shape_only:
        job_part("paper-shaped job, vLLM rollouts", "jobs/train_qwen35_shape.yaml",
                 ["model.dtype=bfloat16", "pools.rollout.backend=vllm", "sampling.prompts_per_step=4", "budget.total_steps=3"], args.updates)


if __name__ == "__main__":
    main()
