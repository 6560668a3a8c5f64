"""Host tensors to the device without making the host wait."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` on `device` (in `dtype`, if given), queued behind the device's work rather than after it: a blocking
    host-to-device copy first waits for everything queued on the stream (in a learner's micro-batch, the forward
    before it); a non-blocking one from pageable memory is staged at once and read by the device in stream order.
    A tensor already there is returned as it is."""
    return tensor.to(device=device, dtype=dtype, non_blocking=True)
