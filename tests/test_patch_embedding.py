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
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()  # a gradient that differs per output
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("conv, shape", [
    (nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4)), (5, 3, 2, 4, 4)),  # Qwen-VL's patch embedding, small
    (nn.Conv2d(6, 4, kernel_size=2, stride=2), (7, 6, 2, 2)),  # GLM-4V's 2 x 2 downsampling
])
def test_a_kernel_sized_input_gives_the_convolutions_values_and_gradients(conv, shape):
    torch.manual_seed(0)
    switched = copy.deepcopy(conv)
    assert patches_as_matmul(switched) == [""] and isinstance(switched, (PatchConv2d, PatchConv3d))
    x = torch.randn(shape)
    for ours, reference in zip(values_and_gradients(switched, x), values_and_gradients(conv, x)):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    larger = torch.randn(2, *shape[1:2], *(2 * n for n in shape[2:]))  # not one kernel in size: the convolution runs
    torch.testing.assert_close(switched(larger), conv(larger), rtol=0, atol=0)


def test_a_patch_embeds_alike_whatever_the_rows_and_threads_sharing_its_call():
    """Bit for bit: each patch's embedding from one call of 900 patches, from calls of 1-100 patches, and on one thread.
    The reference-equality tests rely on it (a role and the in-process reference batch the same patches differently);
    without the padding to MIN_ROWS, calls of 7 rows round ~40% of the values differently (measured)."""
    torch.manual_seed(0)
    layer = copy.deepcopy(nn.Conv3d(3, 64, kernel_size=(2, 16, 16), stride=(2, 16, 16)))  # Qwen3.5's patch, toy width
    patches_as_matmul(layer)
    x = torch.randn(900, 3, 2, 16, 16)
    with torch.no_grad():
        whole = layer(x)
        for rows in (1, 7, 40, 100):
            assert torch.equal(torch.cat([layer(x[i:i + rows]) for i in range(0, len(x), rows)]), whole), rows
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(layer(x), whole) and torch.equal(torch.cat([layer(x[i:i + 7]) for i in range(0, 900, 7)]), whole)
        finally:
            torch.set_num_threads(threads)


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
