"""Answer accuracy of a VLM at a visual budget: greedy decoding on reduced prompts, exact-match scoring.

The same selection and reduced-prompt path as the rollouts (`QwenVLM.select` /
`reduce`), so an evaluation at budget r sees exactly what a student trained at r
sees. Budget 10000 bps keeps every visual token (the full-token score).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lt_opd_ray.core.answers import parse_answer
from lt_opd_ray.core.curriculum import BPS
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.seeding import eval_selection_seed
from lt_opd_ray.core.selectors import build_selector
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.processor import VLMProcessor, encode_samples
from lt_opd_ray.models.sampler import SamplingParams, sample

@dataclass
class Evaluation:
    budget_bps: int
    selector: str
    responses: list[str]
    correct: list[bool]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)

    def by_kind(self, samples: list[Sample]) -> dict[str, float]:
        """Accuracy on the samples of each kind of question (`Sample.kind`, in the order scored); {} where none has one."""
        counts: dict[str, list[int]] = {}
        for row, correct in zip(samples, self.correct, strict=True):
            if row.kind is not None:
                tally = counts.setdefault(row.kind, [0, 0])
                tally[0], tally[1] = tally[0] + correct, tally[1] + 1
        return {kind: right / total for kind, (right, total) in counts.items()}


@torch.no_grad()
def generate_responses(
    vlm: QwenVLM,
    processor: VLMProcessor,
    samples: list[Sample],
    budget_bps: int,
    selector: str = "cdpruner",
    k_min: int = 1,
    system_prompt: str | None = None,
    max_new_tokens: int = 16,
    batch_size: int = 32,
    stop: tuple[str, ...] = (),
    scope: str = "image",
) -> list[str]:
    """Greedy responses of `vlm` with `selector` at `budget_bps` (10000: every visual token), one per sample; `scope`:
    what one budget covers in a row of several images (selectors.SCOPES)."""
    choose = build_selector(selector, scope)
    tokenizer = processor.tokenizer
    params = SamplingParams(
        max_new_tokens=max_new_tokens, greedy=True, top_k_logprobs=None, stop=stop, eos_token_ids=processor.eos_token_ids
    )
    was_training = vlm.model.training
    vlm.model.eval()
    responses = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        reduced = []
        for prompt, s in zip(encode_samples(processor, chunk, system_prompt), chunk):
            features = vlm.visual_features(prompt, with_attention=budget_bps < BPS and choose.reads_encoder_attention)
            reduced.append(vlm.reduced_prompt(prompt, features, choose, budget_bps, k_min, seed=eval_selection_seed(s.uid)))
        completions = sample(vlm, reduced, params, [0] * len(reduced), tokenizer)
        responses += [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    vlm.model.train(was_training)
    return responses


def evaluate_answers(
    vlm: QwenVLM,
    processor: VLMProcessor,
    samples: list[Sample],
    budget_bps: int,
    selector: str = "cdpruner",
    k_min: int = 1,
    system_prompt: str | None = None,
    max_new_tokens: int = 16,
    batch_size: int = 32,
) -> Evaluation:
    """Greedy answers at `budget_bps`; a sample is correct when its parsed <answer> equals `answer`."""
    check_answerable(samples)  # before any generation
    responses = generate_responses(
        vlm, processor, samples, budget_bps, selector, k_min, system_prompt, max_new_tokens, batch_size, stop=("</answer>",)
    )
    return score_answers(samples, responses, budget_bps, selector)


def check_answerable(samples: list[Sample]) -> None:
    unanswerable = [s.uid for s in samples if s.answer is None]
    if unanswerable:
        raise ValueError(f"samples without a reference answer cannot be scored: {', '.join(unanswerable[:5])}")


def score_answers(samples: list[Sample], responses: list[str], budget_bps: int, selector: str) -> Evaluation:
    """Exact match of each response's parsed <answer> against the sample's reference answer."""
    check_answerable(samples)
    correct = [parse_answer(r) == str(s.answer).strip().lower() for r, s in zip(responses, samples)]
    return Evaluation(budget_bps, selector, responses, correct)
