"""Update seconds of the embedded tiny job (`jobs/train_tiny.yaml`: 4 prompts x 2 responses, one rollout worker, one
teacher replica, two ZeRO-2 learner ranks, transformers engines) for each model family, for rows of three images and
for rows of a 16-frame clip: the same job, one field changed per case, each through the whole distributed runtime.

    python benchmarks/bench_families.py            # 10 cases x (start + 5 updates), several minutes on 2 cores
    python benchmarks/bench_families.py --steps 3

Per case: the visual tokens of a prompt at full budget (and kept at the first update's 25%), the median step and its
phase split over the updates after the first (warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray

from lt_opd_ray.config.loading import load_job

CASES = {  # name -> job overrides
    "qwen3_5": ["model.path=tiny:qwen3_5"],
    "qwen3_vl": ["model.path=tiny:qwen3_vl"],
    "qwen2_5_vl": ["model.path=tiny:qwen2_5_vl"],
    "glm4v": ["model.path=tiny:glm4v"],
    "qwen3_5, 3 images per row": ["model.path=tiny:qwen3_5", "data.path=synthetic:64*3", "data.max_images=3"],
    "qwen3_5, a 16-frame clip per row": ["model.path=tiny:qwen3_5", "data.path=synthetic-video:64"],
    "qwen3_5, a 16-frame clip, scope clip": ["model.path=tiny:qwen3_5", "data.path=synthetic-video:64", "selector.scope=clip"],
    "qwen3_vl, a 16-frame clip per row": ["model.path=tiny:qwen3_vl", "data.path=synthetic-video:64"],
    "qwen2_5_vl, a 16-frame clip per row": ["model.path=tiny:qwen2_5_vl", "data.path=synthetic-video:64"],
    "glm4v, a 16-frame clip per row": ["model.path=tiny:glm4v", "data.path=synthetic-video:64"],
}


def run_case(name: str, overrides: list[str], steps: int) -> dict:
    from lt_opd_ray.models.processor import TEXT, VLMProcessor, encode_samples
    from lt_opd_ray.runtime.driver import Driver
    from lt_opd_ray.runtime.launch import init_ray
    from lt_opd_ray.sources.resolve import load_samples, resolve_model_dir

    job = load_job("jobs/train_tiny.yaml", [*overrides, f"checkpoint.dir={tempfile.mkdtemp(prefix='bench-families-')}",
                                            "checkpoint.every_steps=1000000"])
    prompt = encode_samples(VLMProcessor.for_data(resolve_model_dir(job.model.path), job.data), load_samples(job.data.path)[:1],
                            job.data.system_prompt)[0]
    tokens = int((prompt.mm_token_type_ids != TEXT).sum())
    init_ray(job)
    driver = Driver(job)
    logs, seconds = [], []
    try:
        for _ in range(steps):
            begin = time.perf_counter()
            logs.append(driver.run_step())
            seconds.append(time.perf_counter() - begin)
    finally:
        driver.shutdown()
        ray.shutdown()
    warm = slice(1, None)
    return {
        "name": name, "tokens": tokens, "prompt": prompt.input_ids.numel(), "step": statistics.median(seconds[warm]),
        **{p: statistics.median(getattr(log.phases, p) for log in logs[warm]) for p in ("rollout", "teacher", "learner")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="updates per case (the first is warm-up)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE")
    args = parser.parse_args()
    rows = [run_case(name, CASES[name], args.steps) for name in args.cases]
    print(f"== jobs/train_tiny.yaml per case, median of updates 2-{args.steps} (4 prompts x 2 responses, 2 ZeRO-2 learner ranks, 2 CPUs)")
    print(f"{'case':<38} {'visual tokens':>13} {'prompt':>7} {'step s':>7} {'rollout s':>9} {'teacher s':>9} {'learner s':>9}")
    for r in rows:
        print(f"{r['name']:<38} {r['tokens']:>13} {r['prompt']:>7} {r['step']:>7.2f} {r['rollout']:>9.2f} {r['teacher']:>9.2f} {r['learner']:>9.2f}")


if __name__ == "__main__":
    main()
