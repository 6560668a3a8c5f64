"""Weight broadcast from learner rank 0 to every rollout worker over a dedicated process group.

The group is its own gloo (CPU) ProcessGroup over a TCPStore hosted by learner
rank 0, separate from the learners' default group; member 0 sends, members
1..N receive. Each sync sends a header (version, layout hash, bucket count) and
then the weights as flat fp32 buckets of a configurable size, in the order of
`named_parameters()`. A receiver refuses a header whose version is not the next
one or whose layout (names, shapes) differs from its own model, and only
writes weights after every bucket has arrived. A replaced worker rejoins
under a new `generation` (a fresh key prefix in the same store).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)


def bucket_layout(named_shapes: list[tuple[str, tuple[int, ...]]], bucket_bytes: int) -> list[Bucket]:
    """Greedy packing in parameter order into buckets of at most bucket_bytes fp32 bytes (a larger tensor gets its own)."""
    buckets, names, shapes, size = [], [], [], 0
    for name, shape in named_shapes:
        nbytes = int(torch.Size(shape).numel()) * 4
        if names and size + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(names), tuple(shapes)))
            names, shapes, size = [], [], 0
        names.append(name)
        shapes.append(tuple(shape))
        size += nbytes
    if names:
        buckets.append(Bucket(tuple(names), tuple(shapes)))
    return buckets


def layout_hash(named_shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    text = ";".join(f"{n}:{tuple(s)}" for n, s in named_shapes)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def weights_checksum(named_tensors) -> str:
    """A digest of all weights (names, shapes and fp32 bytes): equal digests mean equal weights."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named_tensors:
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class WeightSyncError(RuntimeError):
    pass


class SyncGroup:
    """One member of the weight-sync group (rank 0 = learner rank 0)."""

    def __init__(self, store: dist.Store, rank: int, world: int, generation: int, timeout_s: float):
        prefixed = dist.PrefixStore(f"weight-sync/{generation}", store)
        self.rank, self.world = rank, world
        self.group = dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=timeout_s))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast([tensor], dist.BroadcastOptions()).wait()

    def send(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int) -> int:
        """Broadcast `version` and the weights; returns the bytes sent."""
        named_shapes = [(n, tuple(t.shape)) for n, t in named_tensors]
        buckets = bucket_layout(named_shapes, bucket_bytes)
        self._broadcast(torch.tensor([version, layout_hash(named_shapes), len(buckets)], dtype=torch.int64))
        self._broadcast(torch.tensor([b.numel for b in buckets], dtype=torch.int64))
        tensors = dict(named_tensors)
        sent = 0
        for bucket in buckets:
            flat = torch.cat([tensors[n].detach().float().cpu().reshape(-1) for n in bucket.names])
            self._broadcast(flat)
            sent += flat.numel() * 4
        return sent

    def receive(self, model: torch.nn.Module, expected_version: int, bucket_bytes: int) -> int:
        """Receive every bucket, check it, then write the weights into `model`; returns the version."""
        header = torch.zeros(3, dtype=torch.int64)
        self._broadcast(header)
        version, remote_hash, n_buckets = (int(x) for x in header)
        sizes = torch.zeros(n_buckets, dtype=torch.int64)
        self._broadcast(sizes)
        flats = []
        for size in sizes.tolist():  # everything is received first, so a refusal never leaves the sender hanging
            flat = torch.empty(size, dtype=torch.float32)
            self._broadcast(flat)
            flats.append(flat)
        named = list(model.named_parameters())
        named_shapes = [(n, tuple(p.shape)) for n, p in named]
        buckets = bucket_layout(named_shapes, bucket_bytes)
        if remote_hash != layout_hash(named_shapes) or sizes.tolist() != [b.numel for b in buckets]:
            raise WeightSyncError(
                f"weight update v{version} refused: the sender's parameter names/shapes differ from this model's;"
                " no weight was changed"
            )
        if version != expected_version:
            raise WeightSyncError(f"weight update refused: got version {version}, expected {expected_version}; no weight was changed")
        params = dict(named)
        with torch.no_grad():
            for bucket, flat in zip(buckets, flats):
                offset = 0
                for name, shape in zip(bucket.names, bucket.shapes):
                    n = int(torch.Size(shape).numel())
                    params[name].copy_(flat[offset : offset + n].view(shape))
                    offset += n
        return version

    def close(self) -> None:
        self.group = None


def host_store(host: str, port: int, world: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size=None, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
