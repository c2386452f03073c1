"""Tensor-parallel group state seen by the layers (rank 0 of 1 when not distributed)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

log = logging.getLogger("nvcli")

# --batch-invariant: set on every rank by the model (LlamaForCausalLM.set_batch_invariant)
_rank_ordered_sums = False

# Symmetric-memory all-reduce (init_symmetric_all_reduce): one peer-mapped buffer per rank and its group's name, or
# None (NCCL / gloo for every all-reduce). Set on every rank or on none: the ranks agree before it is set.
_symm_buf: torch.Tensor | None = None
_symm_group: str = ""
# torch's two-shot kernel dispatches on these dtypes only (float16 would raise at the first call)
_SYMM_DTYPES = (torch.bfloat16, torch.float32)


# Inside single_rank(): the layers see one rank whatever the process group (a model only this process runs)
_single_rank = False


def tp_rank() -> int:
    return dist.get_rank() if not _single_rank and dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if not _single_rank and dist.is_available() and dist.is_initialized() else 1


@contextmanager
def single_rank() -> Iterator[None]:
    """Within: tp_rank() is 0, tp_size() 1 and all_reduce the identity, so a model built and run inside (the
    speculative draft model, which only rank 0's process holds) is whole and never waits on the other ranks. Not
    reentrant across threads: the engine's step runs its forwards on one thread."""
    global _single_rank
    before, _single_rank = _single_rank, True
    try:
        yield
    finally:
        _single_rank = before


def set_rank_ordered_sums(on: bool) -> None:
    """Whether all_reduce sums the ranks' parts in rank order (--batch-invariant). NCCL's and gloo's all-reduces
    cut the message into chunks by its size and each chunk starts its sum at another rank, so from three ranks on
    an element's bits depend on how many rows share the message."""
    global _rank_ordered_sums
    _rank_ordered_sums = on


def _ranks_agree(ok: bool, device: torch.device) -> bool:
    """True when `ok` holds on every rank (a MIN all-reduce): the ranks must all take the same all-reduce path, or
    the ones on NCCL and the ones on peer memory would wait on each other forever."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def init_symmetric_all_reduce(max_elems: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Set up all_reduce's symmetric-memory path for messages of up to `max_elems` elements of `dtype`: one buffer
    of that size, peer-mapped across the default group (torch symmetric memory, multicast off). Collective: every
    rank calls it right after init_process_group, before the KV cache is sized from free memory (the buffer then
    counts as used). False, with NCCL / gloo kept for every all-reduce, off CUDA, on one rank, or where anything
    fails (torch without symmetric memory, no P2P between the GPUs, a dtype the kernel lacks)."""
    global _symm_buf, _symm_group
    if device.type != "cuda" or tp_size() == 1 or max_elems < 8:  # same answer on every rank: no collective yet
        return False
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # the lent machines need multicast off
    torch.cuda.set_device(device)  # symm_mem.empty allocates on the current device
    buf: torch.Tensor | None = None
    group = ""
    try:
        if dtype not in _SYMM_DTYPES:
            raise TypeError(f"two-shot all-reduce has no {dtype} kernel")
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        buf = symm_mem.empty(max_elems, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group)
    except Exception as e:  # noqa: BLE001 - any failure keeps NCCL, which always works
        log.info("symmetric-memory all-reduce unavailable, using NCCL: %s: %s", type(e).__name__,
                 str(e).splitlines()[0] if str(e) else "")
        buf = None
    if not _ranks_agree(buf is not None, device):
        return False
    assert buf is not None
    ok = False
    try:  # one eager all-reduce checked against the expected sum: P2P that maps but does not carry data shows here
        n = min(max_elems, 1024) // 8 * 8  # whole 16-byte vectors
        world = tp_size()
        buf[:n].fill_(float(tp_rank() + 1))
        torch.ops.symm_mem.two_shot_all_reduce_(buf[:n], "sum", group)
        ok = bool((buf[:n] == float(world * (world + 1) // 2)).all().item())
        if not ok:
            log.info("symmetric-memory all-reduce gave a wrong sum; using NCCL")
    except Exception as e:  # noqa: BLE001
        log.info("symmetric-memory all-reduce failed its check, using NCCL: %s: %s", type(e).__name__,
                 str(e).splitlines()[0] if str(e) else "")
    if not _ranks_agree(ok, device):
        return False
    _symm_buf, _symm_group = buf, group
    log.debug("symmetric-memory two-shot all-reduce for up to %d elements of %s", max_elems, dtype)
    return True


def release_symmetric_all_reduce() -> None:
    """Drop the symmetric buffer; call after the CUDA graphs that captured it are gone, before
    destroy_process_group."""
    global _symm_buf, _symm_group
    _symm_buf, _symm_group = None, ""


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks, in place; returns x."""
    if tp_size() == 1:
        return x
    if not _rank_ordered_sums:
        buf = _symm_buf
        if (buf is not None and x.is_cuda and x.dtype == buf.dtype and x.numel() <= buf.numel()
                and (x.numel() * x.element_size()) % 16 == 0):  # the kernel's 16-byte vectors
            # Two-shot: each element is summed by exactly one rank (its owner of that slice) and then copied to
            # every rank, so all ranks get identical bits, as the replicated residual stream needs. Stream-ordered
            # copies in and out of a view of the fixed buffer: no host sync, no allocation, CUDA-graph capturable;
            # the kernel's closing barrier keeps peers from still reading the buffer when the next call refills it.
            # Not for --batch-invariant: from three ranks on, which rank sums an element depends on the message size.
            view = buf[: x.numel()].view(x.shape)
            view.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", _symm_group)
            return x.copy_(view)
        dist.all_reduce(x)
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    total = parts[0].float()  # every rank adds the same parts in the same order, elementwise: ((x0 + x1) + x2) + ...
    for part in parts[1:]:
        total += part
    return x.copy_(total)
