"""Zeroed int32 arrival counters for kernels whose last-arriving program finishes the work of a group of
programs (decode attention's split merge, the skinny GEMM's split-K sum): each program counts its arrival
with an acq_rel atomic, and the one that arrives last does the group's epilogue and resets the counter.

The buffers live for the process: kernels leave them zero, and captured CUDA graphs hold their addresses,
so they are never freed or re-zeroed. Kernels on one stream run one after another (a PDL launch touches
no counter before `griddepcontrol.wait`), so they share one buffer; each stream has its own.
"""

from __future__ import annotations

import torch

_buffers: dict[tuple[torch.device, int], list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` zeroed counters on `device` for the current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    bufs = _buffers.setdefault((device, stream), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 8192), dtype=torch.int32, device=device))
    return bufs[-1]


def all_zero() -> bool:
    """Whether every counter is back at zero (tests)."""
    return all(int(buf.count_nonzero()) == 0 for bufs in _buffers.values() for buf in bufs)
