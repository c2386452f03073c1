"""Host-to-device copies that never make the host wait for the device."""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a host tensor) on `device`, copied from pinned memory: to stage a pageable copy CUDA may sync the
    stream first ("API synchronization behavior"), which would stall the host that async scheduling keeps a
    step ahead of the device. On the CPU, `t` itself."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
