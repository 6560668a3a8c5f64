"""Weight broadcast from learner rank 0 to every rollout worker: the transport.

Transport: a process group of its own (gloo on CPU, NCCL on GPU, the same code) over a
TCPStore hosted by learner rank 0, apart from the learners' default group; member 0
sends, members 1..N receive. A replaced worker rejoins under a new `generation`
(a fresh key prefix in the same store).

One sync is a header (version, bucket size, length of the layout), the layout itself and then the weights as
flat buckets in the wire dtype: the student's compute dtype, so a bf16 job sends half the bytes of its fp32
master weights (`layout.py`).

Sink: what a receiver writes into, one (name, tensor) at a time as buckets arrive, so
neither side holds more than one bucket beyond the model: `ModuleSink` (a torch
module's parameters) or the vLLM engine's own parameters (`engines/vllm/engine.py`; `ends.py`).
A receiver checks the version and the layout against its sink before anything is
written and refuses a mismatch whole (still draining the buckets, so the sender
never hangs). A failure in the middle of the stream leaves the sink torn; the worker
then reports no valid version until the next complete sync.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from lt_opd_ray.core.collectives import install_guard_if_asked
from lt_opd_ray.weight_sync.ends import (
    WeightSink,
    WeightSource,
    WeightSyncAborted,
    WeightSyncError,
    WeightUpdateRefused,
)
from lt_opd_ray.weight_sync.layout import Bucket, Layout

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

    def send(self, source: WeightSource, version: int, bucket_bytes: int) -> int:
        """One sync from `source`: the header, then each bucket it streams; returns the weight bytes sent.

        If sending fails (a member died, the driver aborted the group), the source's stream is still consumed to
        its last bucket (a ZeRO-3 learner gathers in each: a collective its peers run too), then WeightSyncError."""
        layout, failure = source.wire_layout(), []
        try:
            self.send_header(layout, version, bucket_bytes)
        except RuntimeError as exc:  # gloo's and NCCL's errors, WeightSyncError
            failure.append(exc)

        def send_bucket(tensors: list[torch.Tensor]) -> int:
            if failure:
                return 0
            try:
                return self.send_bucket(tensors, layout.torch_dtype)
            except RuntimeError as exc:
                failure.append(exc)
                return 0

        nbytes = source.stream_weights(send_bucket, bucket_bytes)
        if failure:
            raise WeightSyncError(f"weight broadcast v{version} stopped after {nbytes} bytes: {str(failure[0])[:300]}"
                                  " (every learner rank finished its gathers; the sync group must be re-formed)")
        return nbytes

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
