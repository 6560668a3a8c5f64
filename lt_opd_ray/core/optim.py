"""AdamW with per-module learning rates (language model / vision encoder / merger / token merge) and linear warm-up.

The merger group is the family's projector (core/families.py): Qwen's patch mergers, GLM-4V's downsampling conv and
gated projection."""

from __future__ import annotations

import torch

from lt_opd_ray.core.families import Family, family_of


def module_of(parameter_name: str, family: Family) -> str:
    """Which learning-rate group a parameter of a `family` model belongs to."""
    if "vision_token_compressor." in parameter_name:
        return "token_merge"
    if any(marker in parameter_name for marker in family.projector):
        return "merger"
    if ".visual." in f".{parameter_name}":
        return "vision_encoder"
    return "language_model"  # decoder layers, embeddings, final norm and lm_head


def param_groups(model: torch.nn.Module, lr) -> list[dict]:
    """One AdamW group per module the recipe trains at its own learning rate; a model lacking one of the three the
    recipe names (its language model, vision encoder, projector) is a ValueError naming the family and the module."""
    family = family_of(model.config.model_type, type(model).__name__)
    groups: dict[str, list] = {"language_model": [], "vision_encoder": [], "merger": [], "token_merge": []}
    names = [name for name, _ in model.named_parameters()]
    for module, markers in (("merger", family.projector), ("vision_encoder", ("visual.",))):
        if not any(module_of(name, family) == module for name in names):
            raise ValueError(f"{family.name} model ({type(model).__name__}) has no {module} parameters (none named by"
                             f" {', '.join(markers)}), which the recipe trains at optimizer.lr.{module}: a checkpoint of another layout?")
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            groups[module_of(name, family)].append(parameter)
    return [{"params": params, "lr": getattr(lr, module), "name": module} for module, params in groups.items() if params]


def build_optimizer(model: torch.nn.Module, config) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (decoupled weight decay) + warm-up of `warmup_steps` updates, then constant; the scheduler steps with the
    optimizer, `steps_per_update` times an update.

    torch's fused AdamW: one kernel over every tensor of a group, on CUDA and on CPU alike (DeepSpeed hands it its
    fp32 partitions); element for element the same update as the per-tensor loop, without a launch per tensor.
    """
    optimizer = torch.optim.AdamW(
        param_groups(model, config.lr),
        betas=tuple(config.betas),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True,
    )
    warmup, steps = config.warmup_steps, config.steps_per_update
    # optimizer step s belongs to update u = s // steps_per_update, which uses lr * (u + 1) / warmup during warm-up
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s // steps + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler
