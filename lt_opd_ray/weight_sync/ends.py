"""The two ends of a weight sync: a source (the learner) streams buckets, a sink (a rollout engine) writes them.

Sinks: `ModuleSink` (a torch module's parameters, the transformers engine) and `EngineSink` (vLLM's own
parameters, engines/vllm/engine.py). Source: the learner (`runtime/learner.Learner`), which gathers each bucket
(under ZeRO-3 a collective every rank calls) and hands it to the transport.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from lt_opd_ray.weight_sync.layout import Layout


class WeightSyncError(RuntimeError):
    pass


class WeightUpdateRefused(WeightSyncError):
    """A header that does not fit the receiver: refused before any weight was written."""


class WeightSyncAborted(WeightSyncError):
    """This member stopped waiting on the group (`SyncGroup.abort`); the group is unusable, a new generation follows."""


class WeightSource(Protocol):
    """Where sent weights come from."""

    def wire_layout(self) -> Layout:
        """Every weight the source sends: names and full shapes (the sink's `shapes`, in the header)."""

    def stream_weights(self, send_bucket: Callable[[list[torch.Tensor]], int] | None, bucket_bytes: int) -> int:
        """Hand each of `wire_layout().buckets(bucket_bytes)`'s full tensors to `send_bucket` in order; returns its bytes."""


class TensorSource:
    """Weights already at hand, as (name, tensor) pairs, sent in `dtype` (tests and benchmarks; the learner is the
    other source)."""

    def __init__(self, named_tensors: list[tuple[str, torch.Tensor]], dtype: str = "float32"):
        self.tensors, self.dtype = dict(named_tensors), dtype
        self.layout = Layout.of(named_tensors, dtype)

    def wire_layout(self) -> Layout:
        return self.layout

    def stream_weights(self, send_bucket, bucket_bytes: int) -> int:
        return sum(send_bucket([self.tensors[n] for n in bucket.names]) for bucket in self.layout.buckets(bucket_bytes))


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
