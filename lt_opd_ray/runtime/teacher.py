"""The frozen full-token teacher behind a Ray Serve deployment, with request batching.

A request is one rollout shard (plus the update's samples); `@serve.batch`
groups requests from several rollout workers into one teacher forward. The
answer is a compact `TeacherPayload`: int32 ids and fp16/fp32 log-probs, one row
per response position. Payloads are validated where they enter the learner
(`unpack_scores`), so a malformed one fails with a message naming the problem.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from ray import serve

from ..config import JobConfig
from ..update import Rollout, TeacherScore


@dataclass
class TeacherPayload:
    lengths: np.ndarray  # [S] int32: response positions per rollout, in shard order
    top_ids: np.ndarray  # [ΣT, k] int32
    top_logp: np.ndarray  # [ΣT, k] fp16 or fp32
    requested_logp: np.ndarray  # [ΣT, k_student + 1]: at the student's top-k ids, then the sampled token
    seconds: float = 0.0
    replica: str = ""

    @property
    def nbytes(self) -> int:
        return self.lengths.nbytes + self.top_ids.nbytes + self.top_logp.nbytes + self.requested_logp.nbytes

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / max(int(self.lengths.sum()), 1)


class MalformedPayloadError(ValueError):
    pass


def pack_scores(scores: list[TeacherScore], value_dtype: str) -> TeacherPayload:
    dtype = np.float16 if value_dtype == "float16" else np.float32
    return TeacherPayload(
        lengths=np.array([s.top_ids.shape[0] for s in scores], dtype=np.int32),
        top_ids=np.concatenate([s.top_ids.numpy().astype(np.int32) for s in scores]),
        top_logp=np.concatenate([s.top_logp.numpy() for s in scores]).astype(dtype),
        requested_logp=np.concatenate([s.requested_logp.numpy() for s in scores]).astype(dtype),
    )


def unpack_scores(payload: TeacherPayload, rollouts: list[Rollout], vocab_size: int, source: str = "teacher") -> list[TeacherScore]:
    """Check a payload against the rollouts it answers, then split it per rollout."""
    import torch

    def fail(reason: str):
        raise MalformedPayloadError(f"malformed teacher payload from {source}: {reason}")

    if not isinstance(payload, TeacherPayload):
        fail(f"expected a TeacherPayload, got {type(payload).__name__}")
    lengths = np.asarray(payload.lengths)
    if lengths.shape != (len(rollouts),):
        fail(f"{lengths.shape[0] if lengths.ndim else 0} lengths for {len(rollouts)} rollouts")
    expected = [r.response_ids.numel() for r in rollouts]
    if lengths.tolist() != expected:
        bad = next(i for i, (a, b) in enumerate(zip(lengths.tolist(), expected)) if a != b)
        fail(f"rollout {bad} has {expected[bad]} response tokens but the payload has {int(lengths[bad])}")
    total = int(lengths.sum())
    k_student = rollouts[0].student_top_ids.shape[1] if rollouts else 0
    if payload.top_ids.dtype != np.int32:
        fail(f"top_ids must be int32, got {payload.top_ids.dtype}")
    if payload.top_ids.ndim != 2 or payload.top_ids.shape[0] != total or payload.top_logp.shape != payload.top_ids.shape:
        fail(f"top_ids {payload.top_ids.shape} / top_logp {payload.top_logp.shape} do not match {total} positions")
    if payload.requested_logp.shape != (total, k_student + 1):
        fail(f"requested_logp has shape {payload.requested_logp.shape}, expected {(total, k_student + 1)}")
    if total and (payload.top_ids.min() < 0 or payload.top_ids.max() >= vocab_size):
        fail(f"top_ids outside the vocabulary [0, {vocab_size})")
    for name in ("top_logp", "requested_logp"):
        values = getattr(payload, name)
        if values.dtype not in (np.float16, np.float32):
            fail(f"{name} must be fp16 or fp32, got {values.dtype}")
        if not np.all(np.isfinite(values)) or np.any(values > 1e-3):
            fail(f"{name} holds values that are not log-probabilities (non-finite or > 0)")
    scores, offset = [], 0
    for n in lengths.tolist():
        rows = slice(offset, offset + n)
        scores.append(
            TeacherScore(
                top_ids=torch.from_numpy(payload.top_ids[rows].copy()),
                top_logp=torch.from_numpy(payload.top_logp[rows].astype(np.float32)),
                requested_logp=torch.from_numpy(payload.requested_logp[rows].astype(np.float32)),
            )
        )
        offset += n
    return scores


class TeacherModel:
    """The frozen full-token teacher: scores rollout shards (transformers, or vLLM with pools.teacher.backend: vllm)."""

    def __init__(self, job: JobConfig, name: str = "teacher"):
        import transformers

        from ..models.adapter import QwenVLM
        from ..models.loading import load_vlm, resolve_model_dir
        from ..models.processor import VLMProcessor
        from .metrics import TeacherMetrics

        transformers.logging.set_verbosity_error()
        self.job, self.name = job, name
        model_dir = resolve_model_dir(job.model.path)
        self.processor = VLMProcessor(model_dir, job.data.min_pixels, job.data.max_pixels)
        self.engine, self.vlm = None, None
        if job.pools.teacher.backend == "vllm":
            from ..engines.vllm_engine import engine_for_job

            self.engine = engine_for_job(job, model_dir, role="teacher")
        else:
            self.vlm = QwenVLM(load_vlm(job.model.path)[1].eval().requires_grad_(False))
        self.metrics = TeacherMetrics(job.name, name)

    def score_shards(self, samples, shards) -> list[TeacherPayload]:
        """Scores every rollout of every shard (each prompt's full-token prefix once); one payload per shard."""
        from ..models.loading import compute_precision
        from ..models.processor import encode_samples
        from ..update import teacher_scores

        begin = time.perf_counter()
        rollouts = [r for shard in shards for r in shard.rollouts]
        used = sorted({r.prompt_index for r in rollouts})
        encoded = dict(zip(used, encode_samples(self.processor, [samples[i] for i in used], self.job.data.system_prompt)))
        if self.engine is not None:
            from ..engines.vllm_roles import vllm_teacher_scores
            from ..models.processor import load_image

            images = {i: [load_image(samples[i].image, samples[i].uid)] for i in used}
            scores = vllm_teacher_scores(self.engine, encoded, images, rollouts, self.job.objective.top_k)
        else:
            with compute_precision(self.job.model.dtype, self.vlm.device):
                scores = teacher_scores(
                    self.vlm, encoded, rollouts, self.job.objective.top_k, self.job.objective.logsoftmax_chunk,
                    self.job.pools.teacher.micro_batch_tokens,
                )
        seconds = time.perf_counter() - begin
        payloads, offset = [], 0
        for shard in shards:
            payload = pack_scores(scores[offset : offset + len(shard.rollouts)], self.job.pools.teacher.payload_dtype)
            payload.seconds, payload.replica = seconds, self.name
            payloads.append(payload)
            offset += len(shard.rollouts)
        self.metrics.record(sum(r.response_ids.numel() for r in rollouts), seconds, sum(p.nbytes for p in payloads))
        return payloads


@serve.deployment
class TeacherDeployment:
    def __init__(self, job: JobConfig):
        import os

        self.model = TeacherModel(job, name=f"teacher-{os.getpid()}")
        self.score_batch.set_max_batch_size(job.pools.teacher.max_batch_size)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def score_batch(self, requests: list[tuple]) -> list[TeacherPayload]:
        # each request: ([samples ref], [shard ref]); the refs are nested so Serve passes them untouched.
        # Requests of the same update (same samples) share one forward; other updates get their own.
        by_update: dict = {}
        for index, request in enumerate(requests):
            by_update.setdefault(request[0][0], []).append(index)
        payloads: list = [None] * len(requests)
        for samples_ref, indices in by_update.items():
            samples = await samples_ref
            shards = [await requests[i][1][0] for i in indices]
            for i, payload in zip(indices, self.model.score_shards(samples, shards)):
                payloads[i] = payload
        return payloads

    async def score(self, request: tuple) -> TeacherPayload:
        return await self.score_batch(request)


def deployment_options(job: JobConfig) -> dict:
    pool = job.pools.teacher
    actor = {"num_cpus": pool.cpus, "num_gpus": pool.gpus, **({"resources": pool.ray_resources()} if pool.node_resource else {})}
    options = {"ray_actor_options": actor, "max_ongoing_requests": pool.max_batch_size * 2}
    if pool.max_replicas > pool.min_replicas:
        options["autoscaling_config"] = {
            "min_replicas": pool.min_replicas,
            "initial_replicas": pool.replicas,
            "max_replicas": pool.max_replicas,
            "target_ongoing_requests": pool.target_queue_per_replica,
            "upscale_delay_s": pool.upscale_delay_s,
            "downscale_delay_s": pool.downscale_delay_s,
        }
    else:
        options["num_replicas"] = pool.replicas
    return options


class TeacherService:
    """Client side: starts the deployment and turns score requests into ObjectRefs."""

    def __init__(self, job: JobConfig):
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})  # handles only, no HTTP
        app = TeacherDeployment.options(**deployment_options(job), logging_config={"log_level": "WARNING"}).bind(job)
        self.app_name = f"{job.name}-teacher"
        self.handle = serve.run(app, name=self.app_name, route_prefix=None)

    def async_score(self, samples_ref, shard_refs: list) -> list:
        """ObjectRef[TeacherPayload] per shard; the bulk data stays in the object store."""
        return [self.handle.score.remote(([samples_ref], [shard])) ._to_object_ref_sync() for shard in shard_refs]

    def replicas(self) -> int:
        """Running replicas of the teacher deployment (moves with autoscaling)."""
        status = serve.status().applications[self.app_name].deployments["TeacherDeployment"]
        return int(status.replica_states.get("RUNNING", 0))

    def shutdown(self) -> None:
        serve.delete(self.app_name)
