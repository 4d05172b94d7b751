"""Host-to-device copies of a row's arrays that never stall the host: a learner queues row after row."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the CPU) on `device`; to a GPU through pinned memory and without blocking, so the copy queues
    behind the work already on the stream instead of waiting for it (a pageable copy synchronises the stream)."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
