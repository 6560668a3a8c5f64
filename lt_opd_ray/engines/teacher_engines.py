"""The teacher's engine: one small protocol, a transformers and a vLLM backend.

A teacher engine holds the frozen full-token model and scores rollouts: for every
response position, the teacher's top-k ids and log-probs plus its log-probs at the
student's top-k ids and the sampled token (`wire.TeacherScore`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.wire import Rollout, TeacherScore

if TYPE_CHECKING:
    from lt_opd_ray.engines.transformers.teacher import TeacherPrefix

# Updates whose groups can be in flight at once (schedule.max_staleness <= 1): what a head start is kept for.
UPDATES_IN_FLIGHT = 2


class TeacherEngine(Protocol):
    runner: str
    """What scores: "transformers", or which of vLLM's model runners."""
    missing_kernels: tuple[str, ...]
    """Fast-kernel packages the model falls back from in this process (models/kernels.py)."""

    def prefill(self, update: int, samples: dict[int, Sample]) -> int:
        """A head start on these prompts of `update`, taken while their rollouts are sampled: the work that needs no
        rollouts, kept for `score` of the same update. Returns the prompts it ran (0: nothing to start early)."""

    def score(self, samples: dict[int, Sample], rollouts: list[Rollout], update: int) -> list[TeacherScore]:
        """One score per rollout of `update`; `samples[r.prompt_index]` is each rollout's sample."""


class TransformersTeacherEngine:
    """The teacher as a transformers module: each prompt's full-token prefix runs once (`prefill`, while the
    rollouts are sampled, or else in `score`), its responses continue from the shared cache in token-budgeted
    micro-batches (`engines/transformers/teacher.teacher_scores`)."""

    runner = "transformers"

    def __init__(self, job: JobConfig):
        from lt_opd_ray.models.adapter import QwenVLM
        from lt_opd_ray.models.kernels import missing_kernels
        from lt_opd_ray.models.loading import load_vlm
        from lt_opd_ray.models.processor import VLMProcessor
        from lt_opd_ray.sources.resolve import resolve_model_dir

        self.job = job
        model_dir, model = load_vlm(resolve_model_dir(job.model.path), dtype=job.model.dtype)  # frozen: in the compute dtype
        self.processor = VLMProcessor.for_data(model_dir, job.data)
        self.vlm = QwenVLM(model.eval().requires_grad_(False))
        self.missing_kernels = missing_kernels(model.config.model_type)
        self.prefixes: dict[tuple[int, int], TeacherPrefix] = {}  # (update, prompt index) -> prefix run ahead

    def prefill(self, update: int, samples: dict[int, Sample]) -> int:
        from lt_opd_ray.engines.transformers.teacher import teacher_prefix
        from lt_opd_ray.models.loading import compute_precision

        # older prefixes belong to groups that were scored elsewhere (a retry on another replica) and are let go
        self.prefixes = {key: prefix for key, prefix in self.prefixes.items() if key[0] > update - UPDATES_IN_FLIGHT}
        todo = [i for i in sorted(samples) if (update, i) not in self.prefixes]
        with compute_precision(self.job.model.dtype, self.vlm.device):
            for i, prompt in zip(todo, self.encode(samples, todo)):
                self.prefixes[(update, i)] = teacher_prefix(self.vlm, prompt)
        return len(todo)

    def score(self, samples: dict[int, Sample], rollouts: list[Rollout], update: int) -> list[TeacherScore]:
        from lt_opd_ray.engines.transformers.teacher import teacher_scores
        from lt_opd_ray.models.loading import compute_precision

        job = self.job
        used = sorted({r.prompt_index for r in rollouts})
        ahead = {i: self.prefixes.pop((update, i)) for i in used if (update, i) in self.prefixes}
        rest = [i for i in used if i not in ahead]
        encoded = dict(zip(rest, self.encode(samples, rest)))
        with compute_precision(job.model.dtype, self.vlm.device):
            return teacher_scores(
                self.vlm, encoded, rollouts, job.objective.top_k, job.objective.logsoftmax_chunk, job.pools.teacher.micro_batch_tokens, ahead,
                job.pools.teacher.packing,
            )

    def encode(self, samples: dict[int, Sample], indices: list[int]):
        from lt_opd_ray.models.processor import encode_samples

        return encode_samples(self.processor, [samples[i] for i in indices], self.job.data.system_prompt)


class VLLMTeacherEngine:
    """The teacher inside a vLLM engine (prompt log-probs of each full-token prompt + response)."""

    missing_kernels = ()  # vLLM brings its own kernels

    def __init__(self, job: JobConfig):
        from lt_opd_ray.engines.vllm.job import open_for_job

        self.job = job
        self.processor, self.engine = open_for_job(job, role="teacher")

    @property
    def runner(self) -> str:
        return self.engine.runner

    def prefill(self, update: int, samples: dict[int, Sample]) -> int:
        """Nothing: vLLM reads no prefix cache for prompt log-probs, so each response prefills its prompt anew
        (docs/gpu.md)."""
        return 0

    def score(self, samples: dict[int, Sample], rollouts: list[Rollout], update: int) -> list[TeacherScore]:
        from lt_opd_ray.engines.vllm.roles import vllm_teacher_scores
        from lt_opd_ray.models.processor import encode_samples, sample_images

        used = sorted({r.prompt_index for r in rollouts})
        encoded = dict(zip(used, encode_samples(self.processor, [samples[i] for i in used], self.job.data.system_prompt)))
        images = {i: sample_images(samples[i]) for i in used}
        return vllm_teacher_scores(self.engine, encoded, images, rollouts, self.job.objective.top_k)


ENGINES = {"transformers": TransformersTeacherEngine, "vllm": VLLMTeacherEngine}


def build_teacher_engine(job: JobConfig) -> TeacherEngine:
    return ENGINES[job.pools.teacher.backend](job)
