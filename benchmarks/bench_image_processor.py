"""Image preprocessing: transformers' PIL image processor against its torchvision one (the one vLLM loads).

Side by side on the same images, fp32 pixel values out: milliseconds per image, and how far the two outputs differ
(one intensity level, 1/127.5 after Qwen's normalisation, on the pixels whose resize rounds the other way). Sizes:
the toy boards (320 x 320 at the toy jobs' bounds: no resize), a 333 x 517 photo into the tiny test bounds, and a 1,500 x 1,000 photo into
the main job's (LT-14K: at most 728 visual tokens).

    python benchmarks/bench_image_processor.py [--repeats 5] [--model tiny:qwen3_5]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import transformers
from PIL import Image

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.sources.resolve import resolve_model_dir
from lt_opd_ray.sources.toy.tasks import toy_task
from timing import best_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="tiny:qwen3_5")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in an actor reserving one CPU or less
    model_dir = resolve_model_dir(args.model)
    rng = np.random.default_rng(0)
    main_job = load_job("jobs/train_qwen35.yaml").data
    cases = {
        "toy board 320x320, 16 images": ([s.images[0].read() for s in toy_task("circles").samples(16, "train")], 102400, 102400),
        "photo 333x517 -> tiny bounds": ([Image.fromarray(rng.integers(0, 255, (333, 517, 3), dtype=np.uint8))], 4096, 65536),
        "photo 1500x1000 -> main job": ([Image.fromarray(rng.integers(0, 255, (1000, 1500, 3), dtype=np.uint8))],
                                        main_job.min_pixels, main_job.max_pixels),
    }
    print(f"{model_dir.name}; one torch thread; best of {args.repeats}; milliseconds per call")
    print(f"{'images':<32} {'PIL':>8} {'torchvision':>12} {'ratio':>6} {'values differing':>17} {'max difference':>15}")
    for label, (images, low, high) in cases.items():
        outputs, seconds = [], []
        for name in ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor"):
            processor = getattr(transformers, name).from_pretrained(model_dir)
            processor.size = {"shortest_edge": low, "longest_edge": high}
            took, out = best_of(args.repeats, lambda p=processor: p(images=images, return_tensors="pt"))
            outputs.append(out["pixel_values"])
            seconds.append(took)
        difference = (outputs[0] - outputs[1]).abs()
        print(f"{label:<32} {seconds[0] * 1e3:8.1f} {seconds[1] * 1e3:12.1f} {seconds[0] / seconds[1]:5.1f}x"
              f" {float((difference > 1e-6).float().mean()):16.3%} {float(difference.max()):15.4f}")


if __name__ == "__main__":
    main()
