"""The teacher's engine: one small protocol, a transformers and a vLLM backend.

A teacher engine holds the frozen full-token model and scores rollouts: for every
response position, the teacher's top-k ids and log-probs plus its log-probs at the
student's top-k ids and the sampled token (`wire.TeacherScore`).
"""

from __future__ import annotations

from typing import Protocol

from ..config import JobConfig
from ..data import Sample
from ..wire import Rollout, TeacherScore


class TeacherEngine(Protocol):
    runner: str
    """What scores: "transformers", or which of vLLM's model runners."""
    missing_kernels: tuple[str, ...]
    """Fast-kernel packages the model falls back from in this process (models/kernels.py)."""

    def score(self, samples: dict[int, Sample], rollouts: list[Rollout]) -> list[TeacherScore]:
        """One score per rollout; `samples[r.prompt_index]` is each rollout's sample."""


class TransformersTeacherEngine:
    """The teacher as a transformers module: each prompt's full-token prefix runs once, its responses continue
    from the shared cache in token-budgeted micro-batches (`scoring.teacher_scores`)."""

    runner = "transformers"

    def __init__(self, job: JobConfig):
        from ..models.adapter import QwenVLM
        from ..models.kernels import missing_kernels
        from ..models.loading import load_vlm
        from ..models.processor import VLMProcessor

        self.job = job
        model_dir, model = load_vlm(job.model.path)
        self.processor = VLMProcessor(model_dir, job.data.min_pixels, job.data.max_pixels)
        self.vlm = QwenVLM(model.eval().requires_grad_(False))
        self.missing_kernels = missing_kernels(model.config.model_type)

    def score(self, samples: dict[int, Sample], rollouts: list[Rollout]) -> list[TeacherScore]:
        from ..models.loading import compute_precision
        from ..models.processor import encode_samples
        from ..scoring import teacher_scores

        job = self.job
        used = sorted({r.prompt_index for r in rollouts})
        encoded = dict(zip(used, encode_samples(self.processor, [samples[i] for i in used], job.data.system_prompt)))
        with compute_precision(job.model.dtype, self.vlm.device):
            return teacher_scores(
                self.vlm, encoded, rollouts, job.objective.top_k, job.objective.logsoftmax_chunk, job.pools.teacher.micro_batch_tokens
            )


class VLLMTeacherEngine:
    """The teacher inside a vLLM engine (prompt log-probs of each full-token prompt + response)."""

    missing_kernels = ()  # vLLM brings its own kernels

    def __init__(self, job: JobConfig):
        from .vllm_engine import open_for_job

        self.job = job
        self.processor, self.engine = open_for_job(job, role="teacher")

    @property
    def runner(self) -> str:
        return self.engine.runner

    def score(self, samples: dict[int, Sample], rollouts: list[Rollout]) -> list[TeacherScore]:
        from ..models.processor import encode_samples, load_image
        from .vllm_roles import vllm_teacher_scores

        used = sorted({r.prompt_index for r in rollouts})
        encoded = dict(zip(used, encode_samples(self.processor, [samples[i] for i in used], self.job.data.system_prompt)))
        images = {i: [load_image(samples[i].image, samples[i].uid)] for i in used}
        return vllm_teacher_scores(self.engine, encoded, images, rollouts, self.job.objective.top_k)


ENGINES = {"transformers": TransformersTeacherEngine, "vllm": VLLMTeacherEngine}


def build_teacher_engine(job: JobConfig) -> TeacherEngine:
    return ENGINES[job.pools.teacher.backend](job)
