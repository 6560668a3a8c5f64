"""What one weight sync carries: the layout header (every parameter's name and shape, the wire dtype) and its buckets.

A bucket holds whole groups (one decoder layer, one vision block, ...; `group_key`), so an engine that fuses a
layer's weights (vLLM's qkv_proj, gate_up_proj) receives each layer in one piece. Checksums compare what two
ends hold.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def group_key(name: str) -> str:
    """The unit a bucket never splits: the path through the first numeric component
    (`model.language_model.layers.3`), else the owning module (`model.visual.merger`)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name  # a parameter of the root module is a group of its own


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)


@dataclass(frozen=True)
class Layout:
    """What one sync sends: parameter names and shapes in send order, and the wire dtype."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str  # a key of WIRE_DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.dtype]

    def buckets(self, bucket_bytes: int) -> list[Bucket]:
        """Greedy packing in send order into buckets of at most bucket_bytes; a group is never split
        (a group larger than a bucket gets a bucket of its own)."""
        element = torch.tensor([], dtype=self.torch_dtype).element_size()
        groups: list[list[int]] = []
        for i, name in enumerate(self.names):
            if groups and group_key(self.names[groups[-1][-1]]) == group_key(name):
                groups[-1].append(i)
            else:
                groups.append([i])
        buckets, current, size = [], [], 0
        for group in groups:
            nbytes = sum(int(torch.Size(self.shapes[i]).numel()) for i in group) * element
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current += group
            size += nbytes
        if current:
            buckets.append(current)
        return [Bucket(tuple(self.names[i] for i in b), tuple(self.shapes[i] for i in b)) for b in buckets]

    def encode(self) -> torch.Tensor:
        text = json.dumps({"names": self.names, "shapes": self.shapes, "dtype": self.dtype})
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)

    @staticmethod
    def decode(data: torch.Tensor) -> Layout:
        fields = json.loads(bytes(data.cpu().numpy()).decode())
        return Layout(tuple(fields["names"]), tuple(tuple(s) for s in fields["shapes"]), fields["dtype"])

    @classmethod
    def of(cls, named_tensors, dtype: str) -> Layout:
        """The layout of (name, tensor) pairs, sent in `dtype`."""
        return cls(tuple(n for n, _ in named_tensors), tuple(tuple(t.shape) for _, t in named_tensors), dtype)

    def mismatches(self, expected: dict[str, tuple[int, ...]], complete: bool = True) -> list[str]:
        """What differs from a sink's names and shapes (empty: the layouts agree); `complete`: every expected weight
        must be sent (a sync), else a subset may be (an in-place update of some weights)."""
        sent = dict(zip(self.names, self.shapes))
        problems = [f"{n}: not a weight of this model" for n in self.names if n not in expected]
        problems += [f"{n}: shape {sent[n]} != {expected[n]}" for n in self.names if n in expected and tuple(expected[n]) != sent[n]]
        problems += [f"{n}: not sent" for n in expected if n not in sent] if complete else []
        return problems


def add_to_digest(digest, name: str, tensor: torch.Tensor) -> None:
    """Feed one named tensor's bytes (in its own dtype) to a hashlib digest."""
    digest.update(name.encode())
    digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def weights_checksum(named_tensors, dtype: torch.dtype | None = None) -> str:
    """A digest of weights (names and bytes in `dtype`, default fp32): equal digests mean equal weights."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named_tensors:
        add_to_digest(digest, name, tensor.detach().to(dtype or torch.float32))
    return digest.hexdigest()
