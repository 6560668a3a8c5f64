"""The vision patch embedding as PyTorch's convolution against the same product as one matrix multiplication.

Side by side, forward alone (the rollout worker and the teacher) and forward + backward (the learner, which trains
the vision tower), at the toy first run's update (16 images of 400 patches, width 64) and at one Qwen3.5-4B image
of the main job's size (2,912 patches: 728 visual tokens after the 2 x 2 merge, width 1,024), fp32 on CPU:

    python benchmarks/bench_patch_embedding.py [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from timing import best_of

SHAPES = {"toy first run update": (16 * 400, 64), "Qwen3.5-4B, one main-job image": (2912, 1024)}  # (patches, width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"Conv3d(3, width, kernel = stride = (2, 16, 16)) on patches of 3 x 2 x 16 x 16; fp32; {torch.get_num_threads()} threads;"
          f" best of {args.repeats}; milliseconds")
    print(f"{'shape':<32} {'conv fwd':>9} {'matmul fwd':>11} {'ratio':>6} {'conv f+b':>9} {'matmul f+b':>11} {'ratio':>6}")
    for label, (patches, width) in SHAPES.items():
        conv = nn.Conv3d(3, width, kernel_size=(2, 16, 16), stride=(2, 16, 16))
        x = torch.randn(patches, 3, 2, 16, 16)

        def matmul(x):  # each output: a flattened patch times a flattened kernel
            return F.linear(x.flatten(1), conv.weight.flatten(1), conv.bias)

        def forward(layer):
            with torch.no_grad():
                return layer(x)

        def forward_backward(layer):
            conv.zero_grad(set_to_none=True)
            layer(x).square().mean().backward()

        row = []
        for run in (forward, forward_backward):
            conv_s, _ = best_of(args.repeats, lambda: run(conv))
            matmul_s, _ = best_of(args.repeats, lambda: run(matmul))
            row += [conv_s * 1e3, matmul_s * 1e3, conv_s / matmul_s]
        print(f"{label:<32} {row[0]:9.1f} {row[1]:11.1f} {row[2]:5.1f}x {row[3]:9.1f} {row[4]:11.1f} {row[5]:5.1f}x")


if __name__ == "__main__":
    main()
