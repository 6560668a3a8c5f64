"""A job's vLLM engines: one opened for a role (rollout or teacher) with the job's settings, and the rollout
worker's weight-sync sink, which writes into the engine's own parameters."""

from __future__ import annotations

from pathlib import Path

import torch

from lt_opd_ray.engines.vllm.engine import VLLMEngine, check_teacher_scoring
from lt_opd_ray.planning.planner import context_length


class EngineSink:
    """The weight-sync sink of a vLLM rollout worker: the engine's own parameters, no second copy of the model.

    With `digest`, it hashes what it writes (as `weights_checksum` in the wire dtype does), so the
    driver can check the engine got exactly the learner's weights.
    """

    def __init__(self, engine: VLLMEngine, digest: bool = False):
        self.engine = engine
        self.digest = digest
        self.last_digest: str | None = None  # of the last complete write, when `digest`

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.engine.weight_shapes()

    def write(self, stream) -> None:
        import hashlib

        from lt_opd_ray.weight_sync.layout import add_to_digest

        self.last_digest = None
        hasher = hashlib.blake2b(digest_size=16) if self.digest else None

        def hashed():
            for name, tensor in stream:
                if hasher is not None:
                    add_to_digest(hasher, name, tensor)
                yield name, tensor

        self.engine.write_weights(hashed())
        self.last_digest = hasher.hexdigest() if hasher is not None else None


def open_for_job(job, role: str):
    """(the job's VLMProcessor, its vLLM engine for `role`): what a vLLM rollout or teacher engine starts from."""
    from lt_opd_ray.models.processor import VLMProcessor
    from lt_opd_ray.sources.resolve import resolve_model_dir

    model_dir = resolve_model_dir(job.model.path)
    return VLMProcessor.for_data(model_dir, job.data), engine_for_job(job, model_dir, role)


def engine_for_job(job, model_dir: Path, role: str) -> VLLMEngine:
    """The vLLM engine of a rollout worker (`role` rollout) or teacher replica, from the job."""
    engine = VLLMEngine(model_dir, **engine_arguments(job, model_dir, role))
    if role == "teacher":
        check_teacher_scoring(engine)
    return engine


def engine_arguments(job, model_dir: Path, role: str) -> dict:
    """What `engine_for_job` opens `role`'s engine on `model_dir` with, once what it refuses of the job is checked.
    (A rollout pool on vLLM for a mode whose responses the student does not sample is the schema's refusal.)"""
    import json

    from lt_opd_ray.core.families import UnsupportedArchitectureError, family_of_config

    config = json.loads((Path(model_dir) / "config.json").read_text())
    family = family_of_config(config, str(model_dir))
    if family.linear_attention and job.model.dtype != "bfloat16" and not torch.cuda.is_available():
        raise UnsupportedArchitectureError(
            f"pools.{role}.backend vllm with model.dtype {job.model.dtype}: vLLM's CPU kernels run {family.name}"
            " (Gated DeltaNet) only in bfloat16; set model.dtype: bfloat16"
        )
    return dict(
        dtype=job.model.dtype,
        max_model_len=context_length(job, config),
        max_logprobs=job.objective.top_k + 1,  # top-k, and k + 1 requested ids per scored row
        max_images=job.data.max_images,
        max_videos=job.data.max_videos,
        seed=job.seed,
        min_pixels=job.data.min_pixels,
        max_pixels=job.data.max_pixels,
        token_merge=role == "rollout" and job.selector.merge == "learnable",
        tuning=getattr(job.pools, role).vllm,
    )
