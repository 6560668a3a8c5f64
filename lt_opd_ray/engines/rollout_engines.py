"""The rollout worker's engine: one small protocol, a transformers and a vLLM backend.

A rollout worker owns one engine that holds the current student. The engine samples
the update's rollouts at a visual budget, answers evaluation prompts greedily, and
is the sink of the weight broadcast. Each backend holds the student once: the
transformers engine as a torch module, the vLLM engine in vLLM's own parameters
(written bucket by bucket by the sync; no transformers copy beside it).
"""

from __future__ import annotations

from typing import Protocol

import torch

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.seeding import eval_selection_seed
from lt_opd_ray.core.wire import Rollout
from lt_opd_ray.weight_sync.ends import WeightSink


def sampling_params(job: JobConfig, processor):
    """The job's sampling settings for the model's sampler (both backends read the same `SamplingParams`)."""
    from lt_opd_ray.models.sampler import SamplingParams

    return SamplingParams(
        max_new_tokens=job.sampling.max_new_tokens,
        temperature=job.sampling.temperature,
        top_p=job.sampling.top_p,
        top_k_logprobs=job.objective.student_top_k,
        stop=tuple(job.sampling.stop),
        eos_token_ids=processor.eos_token_ids,
    )


class RolloutEngine(Protocol):
    def rollout(self, samples: list[Sample], budget_bps: int, update: int) -> list[Rollout]:
        """n responses per sample at `budget_bps`, seeded by (job seed, update, uid, response index); prompt_index is local."""

    def respond(self, samples: list[Sample], budget_bps: int, selector: str, max_new_tokens: int,
                system_prompt: str | None, stop: tuple[str, ...]) -> list[str]:
        """One greedy response per sample with `selector` at `budget_bps` (10000: every visual token)."""

    def sink(self) -> WeightSink:
        """Where the weight broadcast writes the student's new weights."""

    def response_texts(self, rollouts: list[Rollout]) -> list[str]:
        """The rollouts' responses as text, special tokens (the end of sequence) left out: what a reward reads."""

    runner: str
    """What samples: "transformers", or which of vLLM's model runners."""
    missing_kernels: tuple[str, ...]
    """Fast-kernel packages the model falls back from in this process (models/kernels.py)."""

    def weights_checksum(self, dtype: torch.dtype) -> str:
        """A digest of the weights the engine holds, comparable with `weights_checksum` of the learner's in `dtype`."""


def response_texts(processor, rollouts: list[Rollout]) -> list[str]:
    """The rollouts' responses as text, special tokens (the end of sequence) left out: what a reward reads."""
    return processor.tokenizer.batch_decode([r.response_ids.tolist() for r in rollouts], skip_special_tokens=True)


class TransformersRolloutEngine:
    """The student as a transformers module (fp32 master layout, computing under the job's precision).

    Where the teacher writes the responses (objective.mode sequence_kd, teacher_prefix) it also holds a frozen copy
    of the initial weights (the teacher) that samples them at full tokens.
    """

    runner = "transformers"

    def __init__(self, job: JobConfig):
        from lt_opd_ray.core.selectors import build_selector
        from lt_opd_ray.models.adapter import QwenVLM
        from lt_opd_ray.models.kernels import missing_kernels
        from lt_opd_ray.models.loading import load_vlm
        from lt_opd_ray.models.processor import VLMProcessor
        from lt_opd_ray.sources.resolve import resolve_model_dir

        self.job = job
        # neither copy trains here (the sync writes the learners' weights in the compute dtype): both in that dtype
        model_dir, model = load_vlm(resolve_model_dir(job.model.path), token_merge=job.selector.merge == "learnable", dtype=job.model.dtype)
        self.processor = VLMProcessor.for_data(model_dir, job.data)
        self.vlm = QwenVLM(model.eval().requires_grad_(False))
        self.missing_kernels = missing_kernels(model.config.model_type)
        teacher_writes = job.objective.prefixes == "teacher"
        self.behaviour = (QwenVLM(load_vlm(resolve_model_dir(job.model.path), dtype=job.model.dtype)[1].eval().requires_grad_(False))
                          if teacher_writes else None)
        self.selector = build_selector(job.selector.name, job.selector.scope)
        self.params = sampling_params(job, self.processor)

    def rollout(self, samples: list[Sample], budget_bps: int, update: int) -> list[Rollout]:
        from lt_opd_ray.engines.transformers.rollout import rollout
        from lt_opd_ray.models.loading import compute_precision
        from lt_opd_ray.models.processor import encode_samples

        job = self.job
        prompts = encode_samples(self.processor, samples, job.data.system_prompt)
        with compute_precision(job.model.dtype, self.vlm.device):
            return rollout(
                self.vlm, self.processor.tokenizer, prompts, [s.uid for s in samples], self.selector, budget_bps,
                job.budget.k_min, self.params, job.sampling.n, job.seed, update, self.behaviour,
                [s.response for s in samples] if job.objective.prefixes == "dataset" else None,
            )

    def respond(self, samples, budget_bps, selector, max_new_tokens, system_prompt, stop) -> list[str]:
        from lt_opd_ray.models.evaluation import generate_responses
        from lt_opd_ray.models.loading import compute_precision

        with compute_precision(self.job.model.dtype, self.vlm.device):
            return generate_responses(
                self.vlm, self.processor, samples, budget_bps, selector, self.job.budget.k_min, system_prompt, max_new_tokens, stop=stop,
                scope=self.job.selector.scope,
            )

    def response_texts(self, rollouts: list[Rollout]) -> list[str]:
        return response_texts(self.processor, rollouts)

    def sink(self) -> WeightSink:
        from lt_opd_ray.weight_sync.ends import ModuleSink

        return ModuleSink(self.vlm.model)

    def weights_checksum(self, dtype: torch.dtype) -> str:
        from lt_opd_ray.weight_sync.layout import weights_checksum

        return weights_checksum(self.vlm.model.named_parameters(), dtype)


class VLLMRolloutEngine:
    """The student inside a vLLM engine with our pruning plugin; the weight sync writes into its parameters.

    Called from several threads at once (a worker's rollout groups), whose requests share the engine's batch.
    """

    missing_kernels = ()  # vLLM brings its own kernels

    def __init__(self, job: JobConfig):
        import threading

        from lt_opd_ray.engines.vllm.job import EngineSink, open_for_job

        self.job = job
        self.processor, self.engine = open_for_job(job, role="rollout")
        self.params = sampling_params(job, self.processor)
        self._sink = EngineSink(self.engine, digest=job.pools.rollout.verify_weights)
        self._encoding = threading.Lock()  # a Rust tokenizer refuses concurrent calls ("Already borrowed")

    def _encode(self, samples: list[Sample], system_prompt: str | None):
        from lt_opd_ray.models.processor import encode_samples

        with self._encoding:
            return encode_samples(self.processor, samples, system_prompt)

    def rollout(self, samples: list[Sample], budget_bps: int, update: int) -> list[Rollout]:
        from lt_opd_ray.engines.vllm.roles import vllm_rollout
        from lt_opd_ray.models.processor import sample_images

        job = self.job
        prompts = self._encode(samples, job.data.system_prompt)
        return vllm_rollout(
            self.engine, prompts, [sample_images(s) for s in samples], [s.uid for s in samples], job.selector.name,
            budget_bps, job.budget.k_min, self.params, job.sampling.n, job.seed, update,
        )

    def respond(self, samples, budget_bps, selector, max_new_tokens, system_prompt, stop) -> list[str]:
        from lt_opd_ray.engines.vllm.engine import engine_prompt
        from lt_opd_ray.engines.vllm.selection import SelectionRequest
        from lt_opd_ray.models.processor import sample_images
        from lt_opd_ray.models.sampler import SamplingParams

        prompts = self._encode(samples, system_prompt)
        engine_prompts = [engine_prompt(p, sample_images(s), self.engine.video_token_id) for p, s in zip(prompts, samples)]
        params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, top_k_logprobs=None, stop=stop, eos_token_ids=self.processor.eos_token_ids)
        selections = [  # at 10000 bps the selector keeps every visual token
            SelectionRequest(budget_bps=budget_bps, k_min=self.job.budget.k_min, selector=selector, seed=eval_selection_seed(s.uid))
            for s in samples
        ]
        results = self.engine.generate(engine_prompts, selections, params, [0] * len(samples))
        return [self.processor.tokenizer.decode(completion.token_ids, skip_special_tokens=True) for completion, _ in results]

    def response_texts(self, rollouts: list[Rollout]) -> list[str]:
        with self._encoding:  # the Rust tokenizer the sampling threads encode with
            return response_texts(self.processor, rollouts)

    def sink(self) -> WeightSink:
        return self._sink

    @property
    def runner(self) -> str:
        return self.engine.runner

    def weights_checksum(self, dtype: torch.dtype) -> str:
        if not self.job.pools.rollout.verify_weights:
            raise ValueError("a vLLM rollout worker can only report the digest of the weights it was sent: set pools.rollout.verify_weights: true")
        if self._sink.last_digest is None:
            raise ValueError("no complete weight update has been written into this engine yet")
        return self._sink.last_digest


ENGINES = {"transformers": TransformersRolloutEngine, "vllm": VLLMRolloutEngine}


def build_rollout_engine(job: JobConfig) -> RolloutEngine:
    return ENGINES[job.pools.rollout.backend](job)
