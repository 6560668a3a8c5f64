"""Weight broadcast from learner rank 0 to every rollout worker: a transport and a sink.

Transport: a process group of its own (gloo on CPU, NCCL on GPU, the same code) over a
TCPStore hosted by learner rank 0, apart from the learners' default group; member 0
sends, members 1..N receive. A replaced worker rejoins under a new `generation`
(a fresh key prefix in the same store).

One sync is a header (version, bucket size, length of the layout), the layout itself
(every parameter's name and shape and the wire dtype, as JSON bytes) and then the
weights as flat buckets in the wire dtype: the student's compute dtype, so a bf16 job
sends half the bytes of its fp32 master weights. A bucket holds whole groups (one
decoder layer, one vision block, ...; `group_key`), so an engine that fuses a
layer's weights (vLLM's qkv_proj, gate_up_proj) receives each layer in one piece.

Sink: what a receiver writes into, one (name, tensor) at a time as buckets arrive, so
neither side holds more than one bucket beyond the model: `ModuleSink` (a torch
module's parameters) or the vLLM engine's own parameters (`engines.vllm_engine`).
A receiver checks the version and the layout against its sink before anything is
written and refuses a mismatch whole (still draining the buckets, so the sender
never hangs). A failure in the middle of the stream leaves the sink torn; the worker
then reports no valid version until the next complete sync.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from lt_opd_ray.core.collectives import install_guard_if_asked

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

    def mismatches(self, expected: dict[str, tuple[int, ...]]) -> list[str]:
        """What differs from a sink's names and shapes (empty: the layouts agree)."""
        sent = dict(zip(self.names, self.shapes))
        problems = [f"{n}: not a weight of this model" for n in self.names if n not in expected]
        problems += [f"{n}: shape {sent[n]} != {expected[n]}" for n in self.names if n in expected and tuple(expected[n]) != sent[n]]
        problems += [f"{n}: not sent" for n in expected if n not in sent]
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


class WeightSyncError(RuntimeError):
    pass


class WeightUpdateRefused(WeightSyncError):
    """A header that does not fit the receiver: refused before any weight was written."""


class WeightSyncAborted(WeightSyncError):
    """This member stopped waiting on the group (`SyncGroup.abort`); the group is unusable, a new generation follows."""


class WeightSink(Protocol):
    """Where received weights go."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the sink expects: name -> shape."""

    def write(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Consume the stream of (name, tensor in the wire dtype), writing each weight in place."""


class ModuleSink:
    """A torch module's parameters (the transformers rollout engine)."""

    def __init__(self, module: torch.nn.Module):
        self.params = dict(module.named_parameters())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.params.items()}

    def write(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in stream:
                self.params[name].copy_(tensor)  # into the module's own dtype and device


ABANDONED: list = []  # aborted groups with an operation still pending (see SyncGroup._broadcast)


class SyncGroup:
    """One member of the weight-sync group (rank 0 = learner rank 0)."""

    def __init__(self, store: dist.Store, rank: int, world: int, generation: int, timeout_s: float, device: str = "cpu"):
        install_guard_if_asked()
        prefixed = dist.PrefixStore(f"weight-sync/{generation}", store)
        self.rank, self.world, self.device, self.generation = rank, world, torch.device(device), generation
        self.aborted = threading.Event()
        timeout = timedelta(seconds=timeout_s)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world, options)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast from member 0, finished on the device when this returns, or aborted.

        The host polls the work until it is complete: under NCCL that is when the device has finished
        (`wait()` would only order the current stream after the collective and return at once), so a
        sync's seconds are the transfer's and a bucket is never reused while in flight. Between polls
        it checks `abort()`: a member that died mid-stream leaves the others blocked in the collective
        (NCCL detects no dead peer; gloo only at its timeout), and the driver frees them this way.
        """
        if tensor.device != self.device:
            raise WeightSyncError(f"weight sync over {self.device.type}: got a tensor on {tensor.device}")
        if self.aborted.is_set():
            raise WeightSyncAborted(f"weight-sync group {self.generation} was aborted")
        work = self.group.broadcast([tensor], dist.BroadcastOptions())
        pause = 1e-4
        while not work.is_completed():
            if self.aborted.wait(pause):
                if self.device.type == "cuda":
                    self.group.abort()  # ncclCommAbort: frees the communicator's blocked kernels
                # gloo cannot cancel the op: its thread waits out the group's timeout, and destroying the group
                # would wait with it, so the group is parked, never destroyed, while a new generation takes over
                ABANDONED.append(self.group)
                raise WeightSyncAborted(f"weight-sync group {self.generation} was aborted mid-stream")
            pause = min(2 * pause, 1e-3)  # at most ~1 ms past a finished bucket: the sync is hundreds of buckets
        work.wait()  # raises the collective's own error (a peer that closed its connection, a timeout)
        return tensor

    def abort(self) -> None:
        """Stop waiting on this group, from another thread (the actor's control concurrency group)."""
        self.aborted.set()

    # ------------------------------------------------------------------ sender
    def send_header(self, layout: Layout, version: int, bucket_bytes: int) -> int:
        """Announce a sync; then call `send_bucket` once per `layout.buckets(bucket_bytes)`. Returns the header bytes."""
        encoded = layout.encode().to(self.device)
        self._broadcast(torch.tensor([version, bucket_bytes, encoded.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(encoded)
        return 24 + encoded.numel()

    def send_bucket(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> int:
        """One bucket, its tensors flattened in the wire dtype; returns the bytes sent."""
        flat = torch.cat([t.detach().to(device=self.device, dtype=dtype).reshape(-1) for t in tensors])
        self._broadcast(flat)
        return flat.numel() * flat.element_size()

    def send(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int, dtype: str = "float32") -> int:
        """Header and every bucket of tensors already at hand; returns the weight bytes sent."""
        layout = Layout(tuple(n for n, _ in named_tensors), tuple(tuple(t.shape) for _, t in named_tensors), dtype)
        tensors = dict(named_tensors)
        self.send_header(layout, version, bucket_bytes)
        return sum(self.send_bucket([tensors[n] for n in b.names], layout.torch_dtype) for b in layout.buckets(bucket_bytes))

    # ---------------------------------------------------------------- receiver
    def receive(self, sink: WeightSink, expected_version: int) -> int:
        """Receive one sync into `sink`; returns its version."""
        header = self._broadcast(torch.zeros(3, dtype=torch.int64, device=self.device))
        version, bucket_bytes, layout_bytes = (int(x) for x in header)
        layout = Layout.decode(self._broadcast(torch.empty(layout_bytes, dtype=torch.uint8, device=self.device)))
        buckets = layout.buckets(bucket_bytes)
        problems = layout.mismatches(sink.shapes())
        refusal = None
        if problems:
            refusal = (f"weight update v{version} refused: the sender's parameter names/shapes differ from this model's"
                       f" ({len(problems)} problem(s): {'; '.join(problems[:6])}); no weight was changed")
        elif version != expected_version:
            refusal = f"weight update refused: got version {version}, expected {expected_version}; no weight was changed"
        if refusal:
            self._drain(buckets, layout.torch_dtype)  # the sender broadcasts every bucket regardless
            raise WeightUpdateRefused(refusal)
        stream = self._stream(buckets, layout.torch_dtype)
        sink.write(stream)
        if sum(1 for _ in stream):  # a sink that stopped early: the rest is taken off the wire, the group stays in step
            raise WeightSyncError(f"weight update v{version}: the sink did not take every weight; the weights are torn")
        return version

    def _stream(self, buckets: list[Bucket], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in buckets:
            flat = self._broadcast(torch.empty(bucket.numel, dtype=dtype, device=self.device))
            offset = 0
            for name, shape in zip(bucket.names, bucket.shapes):
                n = int(torch.Size(shape).numel())
                yield name, flat[offset : offset + n].view(shape)
                offset += n

    def _drain(self, buckets: list[Bucket], dtype: torch.dtype) -> None:
        for bucket in buckets:
            self._broadcast(torch.empty(bucket.numel, dtype=dtype, device=self.device))

    def close(self) -> None:
        self.group = None


def host_store(host: str, port: int, world: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size=None, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
