"""Patch embeddings as a matrix product (models/patch_embedding.py) against the convolutions they replace."""

import copy

import pytest
import torch
from torch import nn

from lt_opd_ray.core.families import FAMILIES
from lt_opd_ray.models.patch_embedding import PatchConv2d, PatchConv3d, patches_as_matmul


def values_and_gradients(layer: nn.Module, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype)).sum().backward()  # a gradient that differs per output
    return out.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("conv, shape", [
    (nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4)), (5, 3, 2, 4, 4)),  # Qwen-VL's patch embedding, small
    (nn.Conv3d(3, 16, kernel_size=(2, 16, 16), stride=(2, 16, 16)), (300, 3, 2, 16, 16)),  # Qwen3.5's patch, 300 of them
    (nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=False), (0, 3, 2, 4, 4)),  # no bias, no patches
    (nn.Conv2d(6, 4, kernel_size=2, stride=2), (7, 6, 2, 2)),  # GLM-4V's 2 x 2 downsampling
])
def test_a_kernel_sized_input_gives_the_convolutions_values_and_gradients(conv, shape):
    """Against the convolution in fp64 (the product's fp32 rounding alone; oneDNN's fp32 bias gradient over 300
    patches is itself 2e-4 from it, the product's 6e-6: measured)."""
    torch.manual_seed(0)
    switched = copy.deepcopy(conv)
    assert patches_as_matmul(switched) == [""] and isinstance(switched, (PatchConv2d, PatchConv3d))
    x = torch.randn(shape)
    for ours, exact in zip(values_and_gradients(switched, x), values_and_gradients(copy.deepcopy(conv).double(), x.double())):
        # fp32 rounding of sums over a kernel's up to 1,536 entries (values) or 300 patches (gradients, entries up to ~35)
        torch.testing.assert_close(ours, None if exact is None else exact.float(), rtol=1e-5, atol=5e-5)
    larger = torch.randn(2, *shape[1:2], *(2 * n for n in shape[2:]))  # not one kernel in size: the convolution runs
    torch.testing.assert_close(switched(larger), conv(larger), rtol=0, atol=0)


def test_only_unpadded_ungrouped_convolutions_whose_kernel_is_their_stride_switch():
    model = nn.Sequential(nn.Conv3d(3, 8, 2, stride=2), nn.Conv3d(3, 8, 3, stride=1), nn.Conv2d(4, 4, 2, stride=2, padding=1),
                          nn.Conv2d(4, 4, 2, stride=2, groups=2), nn.Conv2d(4, 4, 2, stride=2, dilation=2), nn.Conv2d(4, 4, 2, stride=2))
    assert patches_as_matmul(model) == ["0", "5"]
    assert [type(m).__name__ for m in model] == ["PatchConv3d", "Conv3d", "Conv2d", "Conv2d", "Conv2d", "PatchConv2d"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_vlm_switches_the_vision_tower_and_keeps_its_parameters_and_outputs(tiny_dirs, loaded, family):
    """The loaded model against transformers' own (the `loaded` fixture, convolutions as shipped): the same state dict,
    and the same visual features for a real image."""
    from conftest import random_image

    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import question_messages

    shipped, processor, shipped_vlm = loaded[family]
    _, model = load_vlm(tiny_dirs[family], device="cpu")
    kinds = {name: type(module).__name__ for name, module in model.named_modules() if isinstance(module, (nn.Conv2d, nn.Conv3d))}
    assert kinds and set(kinds.values()) <= {"PatchConv2d", "PatchConv3d"}, kinds
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in shipped.state_dict().items()}
    prompt = processor.encode(question_messages("What is it?"), [random_image(3)], "uid-0")
    with torch.no_grad():
        ours, theirs = QwenVLM(model.eval()).visual_features(prompt), shipped_vlm.visual_features(prompt)
    for a, b in zip(ours.embeds, theirs.embeds):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
