"""The learner group: M DeepSpeed ZeRO-2/3 ranks over torch.distributed (gloo on CPU, NCCL on GPU).

Each rank takes an equal, contiguous slice of the update's rollouts; its loss is
the seq-mean-token-mean over its slice, and DeepSpeed averages gradients over
ranks, so with equal slices the step equals one step on the global mean. One
optimizer step per rollout batch.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from ..config import JobConfig
from ..models.adapter import QwenVLM
from ..models.loading import compute_precision, load_vlm
from ..models.processor import VLMProcessor, encode_samples
from ..optim import build_optimizer
from ..update import LossStats, student_loss


class StudentObjective(torch.nn.Module):
    """The engine's module: forward = the LT-OPD loss of the student on replayed rollouts.

    The loss reads lm_head.weight outside lm_head's own forward (chunked
    log-softmax), so under ZeRO-3 it is registered as an external parameter of
    this module: DeepSpeed gathers it for this forward and its backward.
    """

    def __init__(self, model, objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, prompts, rollouts, scores) -> tuple[torch.Tensor, LossStats]:
        return student_loss(QwenVLM(self.model), prompts, rollouts, scores, self.objective)


def deepspeed_config(job: JobConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": job.optimizer.grad_clip,
        "zero_optimization": {"stage": job.pools.learner.zero_stage},
        "bf16": {"enabled": job.model.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,  # our AdamW with per-module groups is a plain torch optimizer
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def rank_slice(count: int, rank: int, world: int) -> slice:
    """Rank r's contiguous share of `count` rollouts; the shares must be equal (see module docstring)."""
    if count % world:
        raise ValueError(f"{count} rollouts do not split evenly over {world} learner ranks: make prompts_per_step * n a multiple of ranks")
    share = count // world
    return slice(rank * share, (rank + 1) * share)


class Learner:
    """One learner rank. Set up the process group first (`init_process_group`)."""

    def __init__(self, job: JobConfig, rank: int, world: int):
        import deepspeed

        self.job, self.rank, self.world = job, rank, world
        model_dir, model = load_vlm(job.model.path)
        self.processor = VLMProcessor(model_dir, job.data.min_pixels, job.data.max_pixels)
        self.model_dir = model_dir
        self.module = StudentObjective(model.train(), job.objective)
        optimizer, scheduler = build_optimizer(model, job.optimizer)
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.module, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(job)
        )
        if job.pools.learner.zero_stage == 3:
            deepspeed.zero.register_external_parameter(self.module, model.lm_head.weight)
        self.steps_done = 0

    def train_step(self, samples, rollouts, scores) -> dict:
        """One optimizer step on this rank's slice of the rollouts (prompt_index refers to `samples`)."""
        share = rank_slice(len(rollouts), self.rank, self.world)
        prompts = encode_samples(self.processor, samples, self.job.data.system_prompt)
        with compute_precision(self.job.model.dtype, self.engine.device):
            loss, stats = self.engine(prompts, rollouts[share], scores[share])
        self.engine.backward(loss)
        self.engine.step()
        self.steps_done += 1
        return {"loss": stats.loss, "divergence": stats.divergence, "importance_weight": stats.importance_weight,
                "top_k_overlap": stats.top_k_overlap, "tokens": stats.tokens, "grad_norm": float(self.engine.get_global_grad_norm() or 0.0)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All student weights as full fp32 tensors (ZeRO-3 shards gathered: a collective, every rank calls it)."""
        import deepspeed

        params = list(self.module.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.job.pools.learner.zero_stage == 3):
            return {name: p.detach().clone().float() for name, p in self.module.model.named_parameters()}

    def save_pretrained(self, directory: str) -> None:
        """The student as a Hugging Face folder (weights, config, tokenizer, image processor); rank 0 writes.

        Written beside `directory` and renamed into place, so a crash never leaves a
        half-written folder under the final name. A collective under ZeRO-3: every rank calls it.
        """
        import shutil
        from pathlib import Path

        state = self.full_state_dict()
        if self.rank != 0:
            return
        final = Path(directory)
        staging = final.with_name(final.name + ".incoming")
        shutil.rmtree(staging, ignore_errors=True)
        self.module.model.save_pretrained(staging, state_dict=state)
        self.processor.tokenizer.save_pretrained(staging)
        self.processor.image_processor.save_pretrained(staging)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)


def init_process_group(rank: int, world: int, master_addr: str, master_port: int, timeout_s: float = 600.0) -> None:
    """The learners' default process group: NCCL on GPU, gloo on CPU."""
    import deepspeed

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
