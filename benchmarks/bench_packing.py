"""Packed rows against padded rows: a learner micro-batch's forward and backward, and the teacher's continuation of a
prompt's cache by its responses; positions computed and seconds.

    python benchmarks/bench_packing.py             # Qwen3.5 and Qwen3-VL, hidden 256, 2 prompts x 8 responses
    python benchmarks/bench_packing.py --repeats 5

The micro-batch is the learner's: reduced prompts (25% of the visual tokens) each followed by a response, the response
lengths long-tailed as a main-job update's are (mean ~44% of the cap, a few at the cap: `sampling.max_new_tokens`
1,024, mean ~450 in docs/scale.md), here with a 256-token cap. Padded computes rows x longest positions; packed
(`pools.learner.packing`, the default) the sequences' own. The teacher's part continues one prompt's full-token
cache with its 8 responses (`pools.teacher.packing`): right-padded rows, each with its own copy of the cache, or one
packed row. The two alternate (A B A B) in one process; each row is the median over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lt_opd_ray.engines.transformers.teacher import teacher_prefix
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.processor import VLMProcessor, encode_samples
from lt_opd_ray.models.tiny import build_tiny_model
from lt_opd_ray.sources.resolve import load_samples


def response_lengths(count: int, cap: int, seed: int = 0) -> list[int]:
    """Long-tailed lengths: exponential with mean 0.44 x cap, cut at the cap (the cut ones end at the cap)."""
    g = torch.Generator().manual_seed(seed)
    drawn = torch.empty(count).exponential_(1 / (0.44 * cap), generator=g)
    return [max(1, min(cap, int(x))) for x in drawn]


def micro_batch(model_dir: Path, prompts: int, responses: int, cap: int):
    """The model in training mode, and (prompt, response ids) per sequence: `responses` long-tailed responses a prompt."""
    from transformers import AutoModelForImageTextToText

    model = QwenVLM(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train())
    encoded = encode_samples(VLMProcessor(model_dir), load_samples(f"synthetic:{prompts}"))
    lengths = response_lengths(prompts * responses, cap)
    rows = [(encoded[i // responses], torch.randint(10, 300, (n,))) for i, n in enumerate(lengths)]
    return model, rows


def step(vlm: QwenVLM, rows, packed: bool) -> tuple[float, int]:
    """One forward + backward of the micro-batch (25% of each prompt's visual tokens kept); seconds, positions."""
    vlm.model.zero_grad(set_to_none=True)
    begin = time.perf_counter()
    reduced, features = [], {}
    for prompt, _ in rows:
        if id(prompt) not in features:
            features[id(prompt)] = vlm.visual_features(prompt)
        f = features[id(prompt)]
        reduced.append(vlm.reduce(prompt, f, [torch.arange(0, e.shape[0], 4) for e in f.embeds]))
    hidden = vlm.response_hidden(reduced, [r for _, r in rows], packed=packed)
    torch.stack([h.float().square().mean() for h in hidden]).sum().backward()
    seconds = time.perf_counter() - begin
    lengths = [p.length + r.numel() for p, (_, r) in zip(reduced, rows)]
    return seconds, sum(lengths) if packed else len(lengths) * max(lengths)


@torch.no_grad()
def teacher_step(vlm: QwenVLM, prefix, responses: list[torch.Tensor], packed: bool) -> tuple[float, int]:
    """The continuation of one prompt's cache by its responses; seconds, response positions computed."""
    begin = time.perf_counter()
    vlm.continue_hidden(prefix.full, prefix.cache, 0, prefix.mask, responses, packed)
    lengths = [r.numel() for r in responses]
    return time.perf_counter() - begin, sum(lengths) if packed else len(lengths) * max(lengths)


def compare(name: str, run, repeats: int) -> None:
    run(True), run(False)  # warm-up
    runs: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
    for _ in range(repeats):
        for packed in (False, True):
            runs[packed].append(run(packed))
    seconds = {mode: statistics.median(s for s, _ in runs[mode]) for mode in runs}
    positions = {mode: runs[mode][0][1] for mode in runs}
    print(f"{name:<22} {positions[False]:>16} {positions[True]:>8} {positions[True] / positions[False]:>6.2f}"
          f"   {seconds[False]:>8.2f} {seconds[True]:>8.2f} {seconds[True] / seconds[False]:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'role, family':<22} {'positions padded':>16} {'packed':>8} {'ratio':>6}   {'s padded':>8} {'packed':>8} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as root:
        for family in ("qwen3_5", "qwen3_vl"):
            vlm, rows = micro_batch(build_tiny_model(family, Path(root) / family, hidden=256), 2, 8, args.cap)
            compare(f"learner, {family}", lambda packed: step(vlm, rows, packed), args.repeats)
            vlm.model.eval()
            with torch.no_grad():
                prefix = teacher_prefix(vlm, rows[0][0])
            compare(f"teacher, {family}", lambda packed: teacher_step(vlm, prefix, [r for _, r in rows[:8]], packed), args.repeats)
    print(f"(response lengths {sorted(response_lengths(16, args.cap))}, the teacher's the first 8; packed / padded)")


if __name__ == "__main__":
    main()
