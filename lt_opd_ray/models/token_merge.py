"""Learnable token merging (the paper's release: CDPruner + learnable merge), docs/token_merge.md.

After the selector keeps K of an image's N post-merger visual tokens x_1..x_N (dimension D):

- assignment: every token i goes to the kept token nearest in cosine, a(i) = argmax_k cos(x_i, x_{s_k}),
  computed in fp32 without gradients on the L2-normalised features; ties go to the kept token first in
  the original order; a kept token is assigned to itself.
- prior: within each kept token's group, the discarded tokens share p_i = softmax_i(cos(x_i, x_{a(i)}) / T)
  (T = 1); kept tokens have p = 0.
- learned weight: w_i = p_i * tanh(delta_i), delta_i = v . silu(A LN(x_i) + b + B LN(x_{a(i)})), with LN a
  LayerNorm without affine parameters, [A B] the (64, 2D) input layer and v the (1, 64) output layer.
- merged token k: y_k = x_{s_k} + sum_{i: a(i) = k} w_i (x_i - x_{s_k}), in fp32, cast back to x's dtype.

Kept tokens keep their order and M-RoPE positions; no token is added. v starts at zero, so w = 0 and the
model starts exactly at plain selection. A and B start from 64 evenly spaced rows of the language model's
first MLP gate projection, each scaled to unit norm and divided by sqrt(2) (the same rows in both halves).
Parameter names follow the release: `model.vision_token_compressor.learnable_summary.{input.weight,
input.bias, output.weight}`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lt_opd_ray.core.compression import learnable_merge

HIDDEN = 64  # the release's head width
TEMPERATURE = 1.0
ASSIGN_CHUNK = 1024  # rows of the N x K cosine matrix computed at once
INITIALIZATION = "pretrained_mlp_gate_rows_zero_output_v1"
AGGREGATION = "zero_init_signed_residual_v1"


@torch.no_grad()
def assign_to_kept(features: torch.Tensor, kept: torch.Tensor, temperature: float = TEMPERATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignment [N] long: the slot in `kept` each token merges into, prior [N] fp32) for one image's
    features [N, D] and its sorted kept indices [K]."""
    n, k = features.shape[0], kept.numel()
    if k == n:  # every token kept (the teacher, full budgets): each is its own group, nothing to compare
        return kept.clone(), torch.zeros(n, dtype=torch.float32, device=features.device)
    unit = F.normalize(features.detach().float(), dim=-1)
    anchors = unit.index_select(0, kept)
    assignment = torch.empty(n, dtype=torch.long, device=unit.device)
    similarity = torch.empty(n, dtype=torch.float32, device=unit.device)
    for start in range(0, n, ASSIGN_CHUNK):
        cos = (unit[start : start + ASSIGN_CHUNK] @ anchors.T).clamp(-1.0, 1.0)
        similarity[start : start + ASSIGN_CHUNK], assignment[start : start + ASSIGN_CHUNK] = cos.max(dim=1)  # first max: lowest slot
    assignment[kept] = torch.arange(k, device=unit.device)
    is_kept = torch.zeros(n, dtype=torch.bool, device=unit.device)
    is_kept[kept] = True
    logits = (similarity / temperature).masked_fill(is_kept, -math.inf)
    group_max = torch.full((k,), -math.inf, device=unit.device).scatter_reduce(0, assignment, logits, reduce="amax")
    group_max = torch.where(torch.isfinite(group_max), group_max, torch.zeros_like(group_max))  # groups of the anchor alone
    weights = torch.exp(logits - group_max[assignment])  # exp(-inf) = 0 for kept tokens
    prior = weights / torch.zeros(k, device=unit.device).scatter_add(0, assignment, weights)[assignment].clamp_min(1e-20)
    return assignment, prior


class LearnableMerge(nn.Module):
    """The release's merge head: LN (no affine) -> Linear(2D, 64) -> SiLU -> Linear(64, 1, no bias), fp32."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.input = nn.Linear(2 * dim, HIDDEN, bias=True, dtype=torch.float32)
        self.output = nn.Linear(HIDDEN, 1, bias=False, dtype=torch.float32)
        nn.init.zeros_(self.input.weight)  # set by initialize_from_gate or loaded; never random
        nn.init.zeros_(self.input.bias)
        nn.init.zeros_(self.output.weight)

    @torch.no_grad()
    def initialize_from_gate(self, gate: torch.Tensor) -> list[int]:
        """A and B from 64 evenly spaced rows of `gate` [intermediate, D], unit-norm / sqrt(2); v = 0."""
        rows = gate.shape[0]
        if rows < HIDDEN or gate.shape[1] != self.dim:
            raise ValueError(f"gate projection {tuple(gate.shape)} cannot initialise a merge head of width {self.dim}")
        picked = [j * (rows - 1) // (HIDDEN - 1) for j in range(HIDDEN)]
        selected = gate.detach().float().cpu()[picked]
        projection = selected / selected.norm(dim=1, keepdim=True) / math.sqrt(2.0)
        self.input.weight.copy_(torch.cat([projection, projection], dim=1))
        self.input.bias.zero_()
        self.output.weight.zero_()
        return picked

    def forward(self, features: torch.Tensor, kept: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The K merged tokens [K, D] of one image's features [N, D] and its route (`assign_to_kept`, computed
        where the tokens were selected and replayed by the learner); differentiable in the features and the head."""
        if kept.numel() == features.shape[0]:
            return features.index_select(0, kept)
        assignment, prior = (t.to(features.device) for t in route)
        with torch.autocast(features.device.type, enabled=False):
            x = features.float()
            anchors = x.index_select(0, kept)
            weight = self.input.weight.float()
            source_hidden = F.linear(self.norm(x), weight[:, : self.dim], self.input.bias.float())  # A LN(x_i) + b, [N, 64]
            anchor_hidden = F.linear(self.norm(anchors), weight[:, self.dim :])  # B LN(x_{s_k}), once per kept token, [K, 64]
            delta = F.linear(F.silu(source_hidden + anchor_hidden[assignment]), self.output.weight.float()).squeeze(-1)
            w = prior * torch.tanh(delta)  # 0 for kept tokens (prior 0)
            residual = (x - anchors[assignment]) * w.unsqueeze(-1)
            merged = anchors.index_add(0, assignment, residual)  # y_k = x_{s_k} + sum_{a(i)=k} w_i (x_i - x_{s_k})
        return merged.to(features.dtype)


class VisionTokenCompressor(nn.Module):
    """Holds the merge head under the release's name (`model.vision_token_compressor.learnable_summary`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.learnable_summary = LearnableMerge(dim)


def attach(model, saved: dict[str, torch.Tensor] | None = None) -> VisionTokenCompressor:
    """Give a Qwen VLM the merge head: with `saved` (its three tensors, release names) or from its gate rows."""
    dim = model.config.text_config.hidden_size
    compressor = VisionTokenCompressor(dim).to(model.lm_head.weight.device)
    if saved is None:
        compressor.learnable_summary.initialize_from_gate(model.model.language_model.layers[0].mlp.gate_proj.weight)
    else:
        prefix = "model.vision_token_compressor."
        missing = [name for name, _ in compressor.named_parameters() if prefix + name not in saved]
        if missing:
            raise ValueError(f"the checkpoint's token merge lacks {', '.join(prefix + m for m in missing)}")
        compressor.load_state_dict({name: saved[prefix + name] for name, _ in compressor.named_parameters()})
    model.model.vision_token_compressor = compressor
    if not configured(model.config):
        model.config.vision_token_compressor = settings(dim)  # saved with the model: a folder says it merges
    return compressor


def settings(dim: int) -> dict:
    """The `vision_token_compressor` entry of config.json, as the release writes it (the keys its loader checks)."""
    return {
        "enabled": True,
        "algorithm": "qwen35_cdpruner_v1",
        "method": "cdpruner",
        "merge": "learnable_nearest_retained_zero_init_residual",
        "reduction": "differentiable_fp32_zero_init_signed_residual",
        "summary": {"enabled": False},
        "learnable_merge": {
            "enabled": True,
            "aggregation": AGGREGATION,
            "initialization": INITIALIZATION,
            "weight_rule": "learnable_residual_mlp_v1",
            "input_hidden_size": dim,
            "hidden_size": HIDDEN,
            "temperature": TEMPERATURE,
            "assignment": "cosine_nearest_retained_original_index_tie",
        },
    }


def configured(config) -> bool:
    """Does a model config (ours or the release's) name a learnable token merge? One whose settings differ from the
    merge implemented here is refused by name."""
    if (merge := learnable_merge(config)) is None:
        return False
    for key, expected in (("aggregation", AGGREGATION), ("hidden_size", HIDDEN), ("temperature", TEMPERATURE)):
        if merge.get(key, expected) != expected:
            raise ValueError(f"config.json vision_token_compressor.learnable_merge.{key} is {merge.get(key)!r}; this runtime implements {expected!r}")
    return True


def saved_tensors(model_dir) -> dict[str, torch.Tensor]:
    """The merge head's tensors from a folder's safetensors (one file or shards)."""
    from pathlib import Path

    from safetensors import safe_open

    found = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            found |= {name: weights.get_tensor(name) for name in weights.keys() if name.startswith("model.vision_token_compressor.")}
    return found


def merge_parameter_shapes(dim: int) -> dict[str, tuple[int, ...]]:
    """The head's tensors as a checkpoint names them."""
    prefix = "model.vision_token_compressor.learnable_summary."
    return {prefix + "input.weight": (HIDDEN, 2 * dim), prefix + "input.bias": (HIDDEN,), prefix + "output.weight": (1, HIDDEN)}


def merge_head(model) -> LearnableMerge | None:
    compressor = getattr(model.model, "vision_token_compressor", None)
    return compressor.learnable_summary if compressor is not None else None
