"""Latency measured on the serving engine (`lt-opd efficiency FOLDER --measure`): time to first token, decode time per
token and end-to-end latency of one request at a time, at every visual token and at each budget.

What is timed is the engine's answer to one request, in process (no HTTP): vLLM where it runs the folder's model (as
`lt-opd serve` picks it), the transformers engine otherwise. Time to first token is the wall time of a request for one
token (prefill, the vision tower and the selection included); end-to-end, of the answer the student writes
(greedy, at most `max_new_tokens`, ending at its own stop string or end token as served); decode per token, for each
image the answer's time less its first token's over the answer's tokens after the first. Each figure is the median
over `repeats` images, each fresh (no cache of vLLM's serves a repeat), after one warm-up request per budget.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lt_opd_ray.core.curriculum import BPS

QUESTION = "Describe the picture in one sentence."
MAX_MODEL_LEN = 8192  # as `lt-opd serve` (its default --max-model-len), capped by the model's positions


@dataclass(frozen=True)
class Answer:
    prompt_tokens: int  # what the language model prefilled: text and kept visual tokens
    tokens: int  # the answer's tokens
    text_tokens: int  # the prompt's tokens that are not visual
    grid_thw: tuple[int, int, int]  # the image's patch grid as the processor sized it


@dataclass(frozen=True)
class MeasuredLatency:
    budget_bps: int
    prompt_tokens: int
    text_tokens: int
    grid_thw: tuple[int, int, int]
    first_token_s: float
    per_token_s: float | None  # None where no answer had a second token
    end_to_end_s: float
    tokens: int  # the answers' median length (the lower middle of an even count)


class AnsweringEngine(Protocol):
    name: str

    def answer(self, image, budget_bps: int, max_new_tokens: int) -> Answer:
        """One request about `image` at `budget_bps`, answered greedily."""


class VLLMAnswering:
    """vLLM's engine with our plugin, as `lt-opd serve` runs it: the folder's selector and k_min, prefix caching off."""

    def __init__(self, folder: Path, compression, defaults):
        from lt_opd_ray.config.pools import VLLMSettings
        from lt_opd_ray.engines.vllm.engine import VLLMEngine, engine_prompt
        from lt_opd_ray.models.processor import VLMProcessor

        self.name = "vLLM"
        config = json.loads((folder / "config.json").read_text())
        positions = int(config.get("text_config", config).get("max_position_embeddings", MAX_MODEL_LEN))
        self.engine = VLLMEngine(folder, dtype="auto" if _on_gpu() else _cpu_dtype(config), max_model_len=min(MAX_MODEL_LEN, positions),
                                 tuning=VLLMSettings(enable_prefix_caching=False))
        self.processor, self.compression, self.defaults = VLMProcessor(folder), compression, defaults
        self._engine_prompt = engine_prompt

    def answer(self, image, budget_bps: int, max_new_tokens: int) -> Answer:
        from lt_opd_ray.core.samples import Sample
        from lt_opd_ray.engines.vllm.selection import SelectionRequest
        from lt_opd_ray.models.processor import encode_samples

        (prompt,) = encode_samples(self.processor, [Sample("latency", (image,), QUESTION)])
        selection = SelectionRequest(budget_bps=budget_bps, k_min=self.compression.k_min, selector=self.compression.selector)
        ((completion, kept),) = self.engine.generate([self._engine_prompt(prompt, [image])], [selection],
                                                     served_params(self.processor, self.defaults, max_new_tokens), seeds=[0])
        visual = int((prompt.mm_token_type_ids != 0).sum())
        return Answer(prompt.input_ids.numel() - visual + sum(k.numel() for k in kept.indices), int(completion.token_ids.numel()),
                      prompt.input_ids.numel() - visual, tuple(prompt.image_grid_thw[0].tolist()))


class TransformersAnswering:
    """The transformers engine `lt-opd serve` falls back to (serving/transformers_server.py)."""

    def __init__(self, folder: Path, compression, defaults):
        from lt_opd_ray.serving.transformers_server import TransformersStudent

        from lt_opd_ray.core.selectors import build_selector

        self.name = "transformers"
        self.student, self.compression, self.defaults = TransformersStudent(folder), compression, defaults
        self.choose = build_selector(compression.selector)  # the folder's, or CDPruner where it names none

    def answer(self, image, budget_bps: int, max_new_tokens: int) -> Answer:
        import torch

        from lt_opd_ray.core.samples import Sample
        from lt_opd_ray.models.processor import encode_samples
        from lt_opd_ray.models.sampler import sample

        vlm, processor = self.student.vlm, self.student.processor
        with torch.inference_mode():
            (prompt,) = encode_samples(processor, [Sample("latency", (image,), QUESTION)])
            features = vlm.visual_features(prompt, with_attention=self.choose.reads_encoder_attention and budget_bps < BPS)
            reduced = vlm.reduced_prompt(prompt, features, self.choose, budget_bps, self.compression.k_min)
            (completion,) = sample(vlm, [reduced], served_params(processor, self.defaults, max_new_tokens), [0], processor.tokenizer)
        visual = int((prompt.mm_token_type_ids != 0).sum())
        return Answer(reduced.length, int(completion.token_ids.numel()), prompt.input_ids.numel() - visual, tuple(prompt.image_grid_thw[0].tolist()))


def served_params(processor, defaults, max_new_tokens: int):
    """Greedy, ending where the served student ends: its stop strings, its end tokens (the folder's generation config's
    `eos_token_id`, which the processor reads)."""
    from lt_opd_ray.models.sampler import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, greedy=True, top_k_logprobs=None, stop=defaults.stop, eos_token_ids=processor.eos_token_ids)


def noise_image(height: int, width: int, seed: int):
    """A fresh RGB image of uniform noise: no two requests share an image (nor any cache of it)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_dtype(config: dict) -> str:
    """vLLM's CPU kernels run Qwen3.5's Gated DeltaNet only in bf16 (as `lt-opd serve` picks)."""
    from lt_opd_ray.core.families import family_of_config

    return "bfloat16" if family_of_config(config).linear_attention else "float32"


def serving_engine(folder: Path) -> AnsweringEngine:
    """The engine `lt-opd serve --engine auto` would serve `folder` with."""
    from lt_opd_ray.core.compression import CompressionConfig, ServingDefaults
    from lt_opd_ray.serving.serve import vllm_refusal

    compression = CompressionConfig.read(folder) or CompressionConfig("cdpruner", BPS, 1)
    defaults = ServingDefaults.read(folder)
    if vllm_refusal(folder, compression) is not None:
        return TransformersAnswering(folder, compression, defaults)
    return VLLMAnswering(folder, compression, defaults)


def measure(engine: AnsweringEngine, height: int, width: int, budgets: list[int], max_new_tokens: int, repeats: int) -> list[MeasuredLatency]:
    """Each budget's medians over `repeats` fresh images, after one warm-up request at that budget."""
    rows = []
    for budget in budgets:
        engine.answer(noise_image(height, width, seed=10**6 + budget), budget, 1)  # warm-up: first-call costs left out
        first, whole, lengths, decode = [], [], [], []
        for repeat in range(repeats):
            image = noise_image(height, width, seed=budget * 1000 + repeat)
            start = time.perf_counter()
            prompt = engine.answer(image, budget, 1)
            first.append(time.perf_counter() - start)
            start = time.perf_counter()
            answered = engine.answer(image, budget, max_new_tokens)
            whole.append(time.perf_counter() - start)
            lengths.append(answered.tokens)
            if answered.tokens >= 2:  # this request's own tokens after the first, against its own first token
                decode.append((whole[-1] - first[-1]) / (answered.tokens - 1))
        rows.append(MeasuredLatency(budget, prompt.prompt_tokens, prompt.text_tokens, prompt.grid_thw, statistics.median(first),
                                    statistics.median(decode) if decode else None, statistics.median(whole), statistics.median_low(lengths)))
    return rows
