"""Vision patch embeddings computed as one matrix product.

The Qwen-VL and GLM-4V vision towers embed each patch (3 channels x 2 frames x 16 x 16 pixels) with a Conv3d
whose kernel is the patch and whose stride is the kernel, applied to inputs exactly one patch in size (GLM-4V's
2 x 2 downsampling Conv2d too). Each output is then the dot product of a flattened patch with a flattened
kernel: a Linear layer. PyTorch's CPU convolution computes it several times slower than the matrix product
(forward and backward; benchmarks.md, "Patch embeddings"), the largest single cost of a toy update in every role.
The layers keep their class's parameters, names and shapes (checkpoints, weight sync and export see no change);
only their forward runs the product, and any input that is not one kernel in size still runs the convolution.
Like every Linear layer of the tower after it (and unlike oneDNN's convolution), a patch's embedding may round
differently, by an ulp, with the number of patches in the call when that number is small (BLAS picks its kernel by
size), and its weight gradient with the thread count (the reduction over patches is split across threads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _PatchAsMatmul:
    """Mixin for a convolution whose kernel is its stride: an input one kernel in size is a matrix product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != tuple(self.kernel_size):
            return super().forward(x)
        # out[n, o] = sum over (c, kernel positions) of x[n, c, ...] * weight[o, c, ...] + bias[o]
        out = F.linear(x.flatten(1), self.weight.flatten(1), self.bias)
        return out.view(x.shape[0], self.out_channels, *(1,) * len(self.kernel_size))


class PatchConv2d(_PatchAsMatmul, nn.Conv2d):
    pass


class PatchConv3d(_PatchAsMatmul, nn.Conv3d):
    pass


AS_MATMUL = {nn.Conv2d: PatchConv2d, nn.Conv3d: PatchConv3d}


def patches_as_matmul(model: nn.Module) -> list[str]:
    """Switch every Conv2d / Conv3d of `model` whose kernel equals its stride (no padding, no dilation, one group)
    to its matrix-product forward, in place; returns the switched modules' names."""
    switched = []
    for name, module in model.named_modules():
        kind = AS_MATMUL.get(type(module))
        if kind is None:
            continue
        padding = module.padding
        unpadded = padding == "valid" if isinstance(padding, str) else not any(padding)
        if tuple(module.kernel_size) == tuple(module.stride) and unpadded and set(module.dilation) == {1} and module.groups == 1:
            module.__class__ = kind  # the same object: parameters, hooks and state dict keys stay as they are
            switched.append(name)
    return switched
