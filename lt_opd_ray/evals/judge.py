"""A reward that needs a model: a VLM judge (`reward.name: judge`, the model `reward.judge`) asked, for each response,
whether it gives its row's reference answer; the reward is the judge's probability of "yes" against "no" (either
capitalised) for the first token of its answer. It reads the row's images, question and answer and the response. Its
prompt ends where its answer begins: a chat template that opens a thinking block after the assistant's turn (Qwen3,
Qwen3.5) is asked to close it empty (`enable_thinking=False`), so the verdict is the next token; a template that
opens one anyway is refused. A call's questions run packed end to end in rows of at most `micro_batch_tokens` (models/packing.py, core/microbatch.py),
each row's images encoded once per call however many of its responses are asked about. In a run it serves from its
own Ray Serve pool (`pools.reward`, runtime/reward_pool.py); the reference calls it in process.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from lt_opd_ray.core.microbatch import Sequence as Question
from lt_opd_ray.core.microbatch import pack
from lt_opd_ray.core.samples import Sample

VERDICTS = ("yes", "no")  # the judge's two answers: its reward is P(yes) / (P(yes) + P(no)) at its next token, either case


def judge_question(sample: Sample, response: str) -> str:
    """What the judge is asked about one response (with the row's images before it)."""
    return (f"{sample.question}\n\nReference answer: {sample.answer}\nResponse: {response}\n"
            f"Does the response give the reference answer? Answer {VERDICTS[0]} or {VERDICTS[1]}.")


class Judge:
    """The judge model, frozen, in its compute dtype, with the processor of the job's data section."""

    def __init__(self, model_path: str, data, dtype: str = "float32", device: str | None = None, micro_batch_tokens: int = 16384):
        from lt_opd_ray.models.adapter import QwenVLM
        from lt_opd_ray.models.loading import load_vlm
        from lt_opd_ray.models.processor import VLMProcessor
        from lt_opd_ray.sources.resolve import resolve_model_dir

        model_dir, model = load_vlm(resolve_model_dir(model_path), device=device, dtype=dtype)
        self.model = model.eval().requires_grad_(False)
        self.vlm, self.micro_batch_tokens = QwenVLM(self.model), micro_batch_tokens
        self.processor = VLMProcessor.for_data(model_dir, data)
        asked = self.processor.tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False, add_generation_prompt=True,
                                                             enable_thinking=False)
        if asked.rfind("<think>") > asked.rfind("</think>"):  # its verdict would be read at its first thought
            raise ValueError(f"the judge {model_path}: its chat template opens a thinking block after the question even with"
                             " enable_thinking=False; use a judge that answers at once")
        self.yes, self.no = (sorted({self.first_token(form) for form in (word, word.capitalize())}) for word in VERDICTS)
        if set(self.yes) & set(self.no):
            raise ValueError(f"the judge's tokenizer begins {VERDICTS[0]!r} and {VERDICTS[1]!r} with the same token: it cannot tell them apart")

    def first_token(self, word: str) -> int:
        ids = self.processor.tokenizer(word, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"the judge's tokenizer encodes {word!r} as no token")
        return ids[0]

    @torch.no_grad()
    def __call__(self, samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
        """P(yes) against P(no) for each response answering its row, in the caller's order: the questions packed in
        rows, each question's last position alone through the head."""
        from lt_opd_ray.models.processor import encode_samples

        asked = [dataclasses.replace(s, question=judge_question(s, r)) for s, r in zip(samples, responses, strict=True)]
        prompts = encode_samples(self.processor, asked, answer_at_once=True)
        features = {}  # a row's images, encoded once: its responses' questions differ in text only
        values = [0.0] * len(prompts)
        for batch in pack([Question(i, i, p.input_ids.numel()) for i, p in enumerate(prompts)], self.micro_batch_tokens, packed=True):
            reduced = []
            for i in batch.sequences:
                if samples[i].uid not in features:
                    features[samples[i].uid] = self.vlm.visual_features(prompts[i])
                row = features[samples[i].uid]
                reduced.append(self.vlm.reduce(prompts[i], row, self.vlm.keep_all(row)))  # every visual token kept
            row = self.vlm.pack_batch(reduced, [torch.zeros(0, dtype=torch.long)] * len(reduced))
            hidden, _ = self.vlm.run_language_model(row)
            last = torch.tensor(list(itertools.accumulate(row.lengths))) - 1  # each question's last position
            logits = self.vlm.lm_head(hidden[0, last.to(hidden.device)]).float()
            yes, no = torch.logsumexp(logits[:, self.yes], dim=1), torch.logsumexp(logits[:, self.no], dim=1)
            for i, value in zip(batch.sequences, torch.sigmoid(yes - no).tolist(), strict=True):  # P(yes) / (P(yes) + P(no))
                values[i] = value
        return values
