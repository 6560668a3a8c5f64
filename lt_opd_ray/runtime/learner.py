"""The learner group: M DeepSpeed ZeRO-2/3 ranks over torch.distributed (gloo on CPU, NCCL on GPU).

Each rank trains on the rollouts of its own contiguous range of the update's
prompts, in token-budgeted micro-batches (`microbatch.Packer`, fed group by group
as the groups' rollouts arrive, in prompt order) whose gradients accumulate into the
update's optimizer step (one per mini-batch where optimizer.steps_per_update splits the update). A micro-batch's forward needs no teacher scores, so it runs
while the teacher is still scoring; the loss waits for them. Every micro-batch loss is
normalised by the update's sequence count over ranks (N / M, as DeepSpeed averages
gradients over the M ranks), so the step is that of the update's seq-mean-token-mean
whatever the micro-batches and however unevenly the prompts split over ranks.
ZeRO-2/3 reduce gradients in every backward, so every rank runs the same number of
micro-batches: a rank with fewer adds zero-weighted ones. The micro-batches and
their order depend only on the rollouts, never on when they arrive, so a streamed
step is deterministic.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta

import torch

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.collectives import all_reduce_max, all_reduce_sum, hold_every_group_for, host_group, install_guard_if_asked
from lt_opd_ray.core.microbatch import MicroBatch, mini_batch_of
from lt_opd_ray.core.optim import build_optimizer
from lt_opd_ray.core.wire import LearnerStepResult, Stopwatch
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.loading import compute_precision, load_vlm
from lt_opd_ray.models.loss import (
    LossStats,
    PolicyInputs,
    StudentForward,
    averages_tokens,
    loss_on_forward,
    sampled_log_probs,
    with_old_log_probs,
    student_forward,
)
from lt_opd_ray.models.processor import VLMProcessor, encode_samples
from lt_opd_ray.runtime.checkpoint_files import weights_only_checkpoint_engine
from lt_opd_ray.runtime.micro_batch_stream import MicroBatchStream, StreamedGroup, chain, until_end_of
from lt_opd_ray.runtime.waits import ProgressMark
from lt_opd_ray.sources.resolve import resolve_model_dir


class StudentObjective(torch.nn.Module):
    """The engine's module, called twice per micro-batch: `forward(prompts, rollouts)` is the student's forward on
    the replayed rollouts (`loss.student_forward`: no teacher scores needed, so it runs while the teacher scores);
    `forward(computed, rollouts, scores, normaliser)` is the loss on it (`loss.loss_on_forward`; scores None where
    the objective reads none); `forward(computed, rollouts, log_probs=True)` the log-probs of the rollouts' own tokens,
    without gradients (`loss.sampled_log_probs`: the old policy of an update's later optimizer steps).

    The loss reads lm_head.weight outside lm_head's own forward (chunked
    log-softmax), so under ZeRO-3 it is registered as an external parameter of
    this module: DeepSpeed gathers it for that forward and its backward. The first call's answer is a dataclass,
    which DeepSpeed does not walk: only the loss carries its backward hooks.
    """

    def __init__(self, model, objective, packed: bool = False):
        super().__init__()
        self.model = model
        self.objective, self.packed = objective, packed

    def forward(self, inputs, rollouts, scores=None, normaliser: float = 1.0, policy: PolicyInputs | None = None, log_probs: bool = False
                ) -> StudentForward | tuple[torch.Tensor, LossStats] | list[torch.Tensor]:
        student = QwenVLM(self.model)
        if not isinstance(inputs, StudentForward):
            return student_forward(student, inputs, rollouts, self.packed)
        if log_probs:
            return sampled_log_probs(student, inputs, rollouts, self.objective.logsoftmax_chunk)
        return loss_on_forward(student, inputs, rollouts, scores, self.objective, normaliser, policy)


def deepspeed_config(job: JobConfig) -> dict:
    return {
        # one "micro-batch" per backward as DeepSpeed counts; the real accumulation boundary is set per update
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": job.optimizer.grad_clip,
        "zero_optimization": {"stage": job.pools.learner.zero_stage},
        "bf16": {"enabled": job.model.dtype == "bfloat16"},
        # an update's 20-40 micro-batch gradients add up, and the ranks' sum is reduced, in fp32: DeepSpeed's default
        # under bf16 is the model's dtype for both, whose 8-bit mantissa drops a small micro-batch's gradient added to
        # a large running sum (tests/test_runtime.py: the accumulated gradient against fp64)
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        "zero_allow_untested_optimizer": True,  # our AdamW with per-module groups is a plain torch optimizer
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class Learner:
    """One learner rank. Set up the process group first (`init_process_group`)."""

    def __init__(self, job: JobConfig, rank: int, world: int):
        deepspeed = import_deepspeed()
        self.job, self.rank, self.world = job, rank, world
        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True  # an fp32 learner's GEMMs (the chunked output head) on tensor cores
        config = deepspeed_config(job)
        zero3 = job.pools.learner.zero_stage == 3
        # ZeRO-3: the weights are created partitioned (never a whole fp32 copy per rank) and loaded shard by shard
        model_dir, model = load_vlm(resolve_model_dir(job.model.path), token_merge=job.selector.merge == "learnable", zero3_config=config if zero3 else None)
        if job.pools.learner.activation_checkpointing:
            # recompute each decoder / vision block in backward: activations of one block per layer stay alive
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.processor = VLMProcessor.for_data(model_dir, job.data)
        self.model_dir = model_dir
        self.module = StudentObjective(model.train(), job.objective, job.pools.learner.packing)
        optimizer, scheduler = build_optimizer(model, job.optimizer)
        self.engine, _, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        self.lockstep = host_group()  # the ranks' flags and counts: host values, never a wait for the device
        weights_only_checkpoint_engine(self.engine)  # a checkpoint's pickles never run code in the learner
        hold_every_group_for(job.collective_timeout_s)  # DeepSpeed made its data-parallel group with torch's default timeout
        if zero3:
            deepspeed.zero.register_external_parameter(self.module, model.lm_head.weight)
        self.steps_done = 0
        self.progress = ProgressMark()  # read by the liveness ping (LearnerActor.alive) while a step runs

    def train_step(self, samples, groups: Iterator[StreamedGroup], total_sequences: int, version: int) -> LearnerStepResult:
        """One optimizer step on this rank's groups, run as micro-batches while later groups still arrive.

        `groups` yields this rank's groups in prompt order (blocking until each one's rollouts are there), of
        `total_sequences` in the update; `samples[prompt_index]` is each one's sample. A micro-batch's forward runs
        as soon as its rollouts are there; its teacher scores are waited for after it, before the loss. Ranks run
        their forwards and backwards in lockstep (ZeRO-3 gathers in each, ZeRO reduces in each backward): before a
        forward they agree whether any rank still has a micro-batch, before a backward whether any has one after it
        (the accumulation boundary), so a rank that is done runs zero-weighted fillers.
        """
        mark = self.progress.mark
        try:
            return self._train_step(samples, groups, total_sequences, version, mark)
        finally:
            mark("idle", working=False)

    def _train_step(self, samples, groups: Iterator[StreamedGroup], total_sequences: int, version: int, mark) -> LearnerStepResult:
        encode = lambda indices: encode_samples(self.processor, [samples[i] for i in indices], self.job.data.system_prompt)  # noqa: E731
        objective, steps = self.job.objective, self.job.optimizer.steps_per_update
        mini_batch = mini_batch_of(sorted(samples), steps)
        learner = self.job.pools.learner
        stream = MicroBatchStream(groups, encode, learner.micro_batch_tokens, objective.policy_gradient, mini_batch, learner.packing,
                                  objective.scale_advantages, leave_flat_out=self.job.reward.dynamic_sampling_rounds > 0)
        source = iter(stream)
        mark(f"u{version} waiting for rollouts", working=False)
        first = next(source, None)
        if first is None:
            raise ValueError(f"learner rank {self.rank} got no rollouts: every rank needs at least one prompt per update")
        source = chain(first, source)
        filler = MicroBatch((0,), (stream.rollouts[0].prompt_index,), 0)  # any real sequence, weighted 0
        old_logp: dict[int, torch.Tensor] = {}  # later steps' old policy (RL baselines): the starting weights' log-probs
        parts, spans, norms, real, passes, positions = [], [], [], 0, 0, 0
        for k in range(steps):
            micro_batches = until_end_of(source, k)
            if averages_tokens(objective) or stream.leave_flat_out:  # a mean over the mini-batch's tokens, or over the
                # sequences of the prompts that take part: every rank's rollouts counted before the first backward
                micro_batches = list(micro_batches)
                mark(f"u{version} lockstep with the other ranks", working=False)
                (count,) = all_reduce_sum([stream.trained_count(objective, [i for mb in micro_batches for i in mb.sequences])], group=self.lockstep)
                normaliser = max(count, 1) / self.world  # every prompt left out: a zero gradient
            elif steps == 1:
                normaliser = total_sequences / self.world  # the ranks' losses are averaged: each divides by its share
            else:  # this mini-batch's sequences over the ranks (each rank's k-th share of its prompts)
                mark(f"u{version} lockstep with the other ranks", working=False)
                (sequences,) = all_reduce_sum([self.job.sampling.n * sum(1 for p in mini_batch.values() if p == k)], group=self.lockstep)
                normaliser = sequences / self.world
            label = f"u{version}" + (f" step{k}" if steps > 1 else "")
            done = self._accumulate(stream, iter(micro_batches), filler, normaliser, old_logp, label, mark)
            parts += done[0]
            spans += done[1]
            real, passes, positions = real + done[2], passes + done[3], positions + done[4]
            if k == 0 and steps > 1:  # every later mini-batch's rollouts, before the weights move (a worker replaced
                rest = list(source)  # inside the step gets the weights the step began with: `send_weights_inside_step`)
                source = iter(rest)
                if objective.policy_gradient:  # only where the starting weights are the old policy (not a version behind)
                    later = [batch for _, batch in rest if batch is not None and stream.compares_with_starting_weights(batch.sequences)]
                    old_logp = self._record_old_log_probs(stream, later, filler, f"u{version}", mark, spans)
            mark(f"{label} optimizer step")
            with Stopwatch() as watch:
                self.engine.step()
            spans.append(watch.span("learner", f"learner-{self.rank}", f"{label} optimizer"))
            norms.append(float(self.engine.get_global_grad_norm() or 0.0))
        self.steps_done += 1
        stats = LossStats.combine(parts).on_host()  # the step's figures, read from the device at once
        return LearnerStepResult(
            loss=stats.loss / steps, divergence=stats.divergence, importance_weight=stats.importance_weight,
            top_k_overlap=stats.top_k_overlap, tokens=stats.tokens, sequences=stats.sequences, prompts=len(stream.prompts),
            micro_batches=real, filler_micro_batches=passes - real, vision_forwards=stats.vision_forwards,
            grad_norm=sum(norms) / steps, seconds=sum(s.seconds for s in spans),
            clipped_share=stats.clipped, logprob_gap=stats.logprob_gap, truncated_sequences=stats.truncated, longest_response=stats.longest,
            sequence_lengths=tuple(stream.lengths), computed_tokens=positions, spans=tuple(spans),
        )

    def _accumulate(self, stream: MicroBatchStream, batches: Iterator[MicroBatch], filler: MicroBatch, normaliser: float,
                    old_logp: dict[int, torch.Tensor], label: str, mark) -> tuple[list[LossStats], list, int, int, int]:
        """One optimizer step's gradients: forward, loss and backward of each micro-batch, in lockstep with the other
        ranks (before a forward they agree whether any rank still has a micro-batch, before a backward whether any
        has one after it, the accumulation boundary; a rank that is done runs zero-weighted fillers). Returns the
        real micro-batches' stats, the spans, and the real and all micro-batch counts and the positions computed."""
        parts, spans, real, passes, positions = [], [], 0, 0, 0
        current = next(batches, None)
        while True:
            mark(f"{label} lockstep with the other ranks", working=False)
            (any_current,) = all_reduce_max([current is not None], group=self.lockstep)  # before the forward: ZeRO-3 gathers in it
            if not any_current:
                break
            batch = current or filler
            name = f"{label} {'mb' if current else 'filler'}{passes}"
            chosen = [stream.rollouts[i] for i in batch.sequences]
            mark(f"{name} forward")
            with Stopwatch() as watch, compute_precision(self.job.model.dtype, self.engine.device):
                computed = self.engine(stream.prompts, chosen)  # needs no teacher scores: runs while the teacher scores
            spans.append(watch.span("learner", f"learner-{self.rank}", f"{name} forward"))
            mark(f"{label} waiting for rollouts", working=False)
            following = next(batches, None) if current is not None else None  # the next groups' rollouts, not scores
            mark(f"{label} lockstep with the other ranks", working=False)
            (any_following,) = all_reduce_max([following is not None], group=self.lockstep)  # the accumulation boundary
            mark(f"{name} waiting for the teacher's scores", working=False)
            scores = stream.scores(batch.sequences)
            policy = stream.policy(batch.sequences)
            if policy is not None and old_logp:
                policy = with_old_log_probs(policy, [old_logp.get(i) for i in batch.sequences])
            mark(f"{name} loss and backward")
            with Stopwatch() as watch:
                self.engine.set_gradient_accumulation_boundary(not any_following)
                with compute_precision(self.job.model.dtype, self.engine.device):
                    loss, stats = self.engine(computed, chosen, scores, normaliser, policy)
                if current is None:
                    loss = loss * 0.0  # a filler: the same graph as a real micro-batch, no contribution
                else:
                    parts.append(stats)
                    real += 1
                    positions += computed.positions  # as the forward ran them (the packer planned batch.computed_tokens)
                self.engine.backward(loss, scale_wrt_gas=False)  # normalised above: no division by the accumulation count
            spans.append(watch.span("learner", f"learner-{self.rank}", name))
            passes += 1
            current = following
        return parts, spans, real, passes, positions

    def _record_old_log_probs(self, stream: MicroBatchStream, batches: list[MicroBatch], filler: MicroBatch, label: str, mark,
                              spans: list) -> dict[int, torch.Tensor]:
        """The log-probs the update's starting weights give the sequences of its later mini-batches (forwards without
        gradients, in lockstep with the other ranks as ZeRO-3 gathers in each), taken before its first optimizer step."""
        recorded: dict[int, torch.Tensor] = {}
        todo = iter(batches)
        current = next(todo, None)
        while True:
            mark(f"{label} lockstep with the other ranks", working=False)
            (any_current,) = all_reduce_max([current is not None], group=self.lockstep)
            if not any_current:
                return recorded
            batch = current or filler
            chosen = [stream.rollouts[i] for i in batch.sequences]
            mark(f"{label} old policy's log-probs")
            with Stopwatch() as watch, torch.no_grad(), compute_precision(self.job.model.dtype, self.engine.device):
                logp = self.engine(self.engine(stream.prompts, chosen), chosen, log_probs=True)
            spans.append(watch.span("learner", f"learner-{self.rank}", f"{label} old log-probs"))
            if current is not None:
                recorded.update(zip(batch.sequences, logp))
            current = next(todo, None)

    @property
    def wire_dtype(self) -> str:
        """The weight broadcast's dtype: the student's compute dtype."""
        return "bfloat16" if self.job.model.dtype == "bfloat16" else "float32"

    def wire_layout(self):
        """Names and full shapes of every student parameter (a ZeRO-3 shard's own shape is empty: ds_shape)."""
        from lt_opd_ray.weight_sync.layout import Layout

        named = list(self.module.model.named_parameters())
        return Layout(tuple(n for n, _ in named), tuple(tuple(getattr(p, "ds_shape", p.shape)) for _, p in named), self.wire_dtype)

    def gathered_buckets(self, bucket_bytes: int) -> Iterator[tuple[tuple[str, ...], list[torch.Tensor]]]:
        """Each bucket's names and full parameters, gathered one bucket at a time (ZeRO-3: a collective, every rank
        runs the loop to its end; the tensors are valid until the next bucket)."""
        import deepspeed

        params = dict(self.module.model.named_parameters())
        for bucket in self.wire_layout().buckets(bucket_bytes):
            chosen = [params[n] for n in bucket.names]
            with deepspeed.zero.GatheredParameters(chosen, modifier_rank=None, enabled=self.job.pools.learner.zero_stage == 3):
                yield bucket.names, chosen

    def stream_weights(self, send_bucket, bucket_bytes: int) -> int:
        """Hand each gathered bucket's full tensors to `send_bucket` (rank 0; None elsewhere). Returns the bytes it reported."""
        sent = 0
        for _, chosen in self.gathered_buckets(bucket_bytes):
            if send_bucket is not None:
                sent += send_bucket(chosen)
        return sent

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every student weight, whole, in the module's own dtype (the compute dtype: bf16 under bf16, whose fp32
        masters only the optimizer reads), copied to host memory by rank 0 alone (no GPU holds a second model, and
        the driver that reads it needs no GPU); the other ranks take part in ZeRO-3's gathers, a bucket at a time,
        and answer None."""
        state = {}
        for names, chosen in self.gathered_buckets(int(self.job.pools.learner.sync_bucket_mb * 2**20)):
            if self.rank == 0:
                state.update((name, p.detach().to("cpu", copy=True)) for name, p in zip(names, chosen))
        return state if self.rank == 0 else None

    def save_pretrained(self, directory: str) -> None:
        """The student as a Hugging Face folder (weights, config, tokenizer, image processor); rank 0 writes.

        Written beside `directory` and renamed into place, so a crash never leaves a
        half-written folder under the final name. A collective under ZeRO-3: every rank calls it.
        """
        import shutil
        from pathlib import Path

        from lt_opd_ray.core.compression import CompressionConfig, ServingDefaults
        from lt_opd_ray.core.model_files import write_file_list

        state = self.full_state_dict()
        if self.rank != 0:
            return
        final = Path(directory)
        staging = final.with_name(final.name + ".incoming")
        shutil.rmtree(staging, ignore_errors=True)
        self.module.model.save_pretrained(staging, state_dict=state)
        self.processor.tokenizer.save_pretrained(staging)
        self.processor.image_processor.save_pretrained(staging)
        CompressionConfig.from_job(self.job).write(staging)  # `lt-opd serve` on final/ serves it at the budget it was trained for
        ServingDefaults(tuple(self.job.sampling.stop), self.processor.eos_token_ids).write(staging)  # ... and ends it where training did
        write_file_list(staging)  # what export, eval and serve check it against
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)


def import_deepspeed():
    """DeepSpeed, imported without its autotuner's optional MLflow hook: `import deepspeed` imports the autotuner,
    which imports MLflow when it is installed (our tracking installs it), 1.9 s of every learner rank's start for a
    tool the learners never run. MLflow stays importable afterwards (the driver's tracking imports it in its own
    process)."""
    import sys

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the autotuner records it has none
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


def init_process_group(rank: int, world: int, master_addr: str, master_port: int, timeout_s: float) -> None:
    """The learners' default process group: NCCL on GPU, gloo on CPU; a collective waits up to `timeout_s`
    (`JobConfig.collective_timeout_s`; `Learner` holds DeepSpeed's own groups to it too)."""
    deepspeed = import_deepspeed()

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    )
    install_guard_if_asked()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray gives each rank one GPU (CUDA_VISIBLE_DEVICES): device 0 is its own
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
