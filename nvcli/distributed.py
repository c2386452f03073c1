"""Tensor-parallel group state seen by the layers (rank 0 of 1 when not distributed)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# --batch-invariant: set on every rank by the model (LlamaForCausalLM.set_batch_invariant)
_rank_ordered_sums = False


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def set_rank_ordered_sums(on: bool) -> None:
    """Whether all_reduce sums the ranks' parts in rank order (--batch-invariant). NCCL's and gloo's all-reduces
    cut the message into chunks by its size and each chunk starts its sum at another rank, so from three ranks on
    an element's bits depend on how many rows share the message."""
    global _rank_ordered_sums
    _rank_ordered_sums = on


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks, in place; returns x."""
    if tp_size() == 1:
        return x
    if not _rank_ordered_sums:
        dist.all_reduce(x)
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    total = parts[0].float()  # every rank adds the same parts in the same order, elementwise: ((x0 + x1) + x2) + ...
    for part in parts[1:]:
        total += part
    return x.copy_(total)
