"""Tensor-parallel group state seen by the layers (rank 0 of 1 when not distributed)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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


# Peer-mapped buffers this process has set up (symm_mem.rendezvous calls), over every engine it ran. torch numbers
# a process's rendezvous exchanges from 0 and matches the ranks' by that number, so a rendezvous between a rank that
# made some before (the driver process is rank 0 of every engine it builds) and fresh worker processes waits forever:
# _rendezvous_in_step checks the counts agree first.
_rendezvous_made = 0

# Inside single_rank(): the layers see one rank whatever the process group (a model only this process runs)
_single_rank = False

# Deferred sums (init_deferred_sums): two peer-mapped buffers, used in turn, each as (this rank's buffer, its
# symmetric-memory handle, every rank's buffer mapped here, in rank order); the next one to use
_deferred: list[tuple[torch.Tensor, Any, list[torch.Tensor]]] = []
_deferred_next = 0


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


def _summary(e: BaseException) -> str:
    """'Type: first line of the message', for a log line about a set-up that fell back."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _ranks_agree(ok: bool, device: torch.device) -> bool:
    """True when `ok` holds on every rank (a MIN all-reduce): the ranks must all take the same all-reduce path, or
    the ones on NCCL and the ones on peer memory would wait on each other forever."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _rendezvous_in_step(device: torch.device) -> bool:
    """True when every rank has set up as many peer-mapped buffers in its process as this one (collective). False
    where an earlier engine of this process set some up and its peers are new processes: a rendezvous would then
    wait forever, so this engine keeps NCCL for its sums."""
    count = torch.tensor([_rendezvous_made, -_rendezvous_made], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count[0].item() == -count[1].item():
        return True
    log.info("peer-mapped buffers off for this engine (NCCL sums): an earlier tensor-parallel engine in this "
             "process set some up, and torch cannot match a second set-up with fresh worker processes")
    return False


def _rendezvous(buf: torch.Tensor, group: str) -> Any:
    """symm_mem.rendezvous, counted (_rendezvous_made) whether or not it succeeds."""
    import torch.distributed._symmetric_memory as symm_mem

    global _rendezvous_made
    _rendezvous_made += 1
    return symm_mem.rendezvous(buf, group)


def init_symmetric_all_reduce(max_elems: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Set up all_reduce's symmetric-memory path for messages of up to `max_elems` elements of `dtype`: one buffer
    of that size, peer-mapped across the default group (torch symmetric memory, multicast off). Collective: every
    rank calls it right after init_process_group, before the KV cache is sized from free memory (the buffer then
    counts as used). False, with NCCL / gloo kept for every all-reduce, off CUDA, on one rank, or where anything
    fails (torch without symmetric memory, no P2P between the GPUs, a dtype the kernel lacks)."""
    global _symm_buf, _symm_group
    if device.type != "cuda" or tp_size() == 1 or max_elems < 8:  # same answer on every rank: no collective yet
        return False
    if not _rendezvous_in_step(device):
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
        _rendezvous(buf, group)
    except Exception as e:  # noqa: BLE001 - any failure keeps NCCL, which always works
        log.info("symmetric-memory all-reduce unavailable, using NCCL: %s", _summary(e))
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
        log.info("symmetric-memory all-reduce failed its check, using NCCL: %s", _summary(e))
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


def _symmetric(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The symmetric buffer where all_reduce sums a tensor of this size and type, else None (NCCL / gloo)."""
    buf = _symm_buf
    if (buf is None or _rank_ordered_sums or device.type != "cuda" or dtype != buf.dtype or numel > buf.numel()
            or (numel * buf.element_size()) % 16):  # the kernel's 16-byte vectors
        return None
    return buf


def reduce_target(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Where a row-parallel GEMM writes its [rows, cols] share to be summed in place (summed_in_place): a view of
    the symmetric buffer when all_reduce would sum such a tensor through it, else None."""
    if tp_size() == 1:
        return None
    buf = _symmetric(rows * cols, dtype, device)
    return None if buf is None else buf[: rows * cols].view(rows, cols)


def summed_in_place(view: torch.Tensor) -> Partial:
    """The all-reduce of a reduce_target view, in the symmetric buffer itself: no copy in, no copy out. Returned as
    a one-part Partial with no handle, whose consumer (sum_add_norm, reduced) reads the sum from the buffer. It must
    do so before the next all_reduce refills the buffer: a row-parallel projection's output is consumed by the next
    add+RMSNorm, and no all-reduce runs in between."""
    torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", _symm_group)
    return Partial((view,), None)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks, in place; returns x."""
    if tp_size() == 1:
        return x
    if not _rank_ordered_sums:
        buf = _symmetric(x.numel(), x.dtype, x.device)
        if buf is not None:
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


@dataclass(frozen=True)
class Partial:
    """This rank's share of a row-parallel projection, not yet summed across the ranks: [rows, cols] in one of the
    deferred-sum buffers (partial_target). Its consumer sums it (sum_add_norm, reduced) before anything else is
    written there: the buffers are used in turn, and the barrier of a sum keeps the next-but-one write away from
    peers still reading. With one part and no handle, the sum itself, in the symmetric all-reduce's buffer
    (summed_in_place)."""

    parts: tuple[torch.Tensor, ...]  # every rank's [rows, cols] view, rank order; or the summed view alone
    handle: Any  # the buffer's symmetric-memory handle (its barrier); None: parts is the sum

    @property
    def local(self) -> torch.Tensor:
        """This rank's view, where its GEMM writes."""
        return self.parts[tp_rank()]


def init_deferred_sums(max_elems: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Set up partial_target's two peer-mapped buffers of `max_elems` elements (collective, right after
    init_symmetric_all_reduce). False, with every sum through all_reduce, off CUDA, on one rank, or where anything
    fails (no symmetric memory, a handle without peer views or barriers, a wrong sum in the check)."""
    global _deferred, _deferred_next
    if device.type != "cuda" or tp_size() == 1 or max_elems < 8 or tp_size() > 8:
        return False
    if not _rendezvous_in_step(device):
        return False
    made: list[tuple[torch.Tensor, Any, list[torch.Tensor]]] = []
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        for _ in range(2):
            buf = symm_mem.empty(max_elems, dtype=dtype, device=device)
            handle = _rendezvous(buf, group)
            made.append((buf, handle, [handle.get_buffer(r, (max_elems,), dtype) for r in range(tp_size())]))
    except Exception as e:  # noqa: BLE001 - any failure keeps all_reduce for every sum
        log.info("deferred sums unavailable: %s", _summary(e))
        made = []
    if not _ranks_agree(bool(made), device):
        return False
    ok = False
    try:  # each rank's buffer holds rank + 1: every rank must read the sum 1 + 2 + ... + world
        world, n = tp_size(), 64
        for buf, handle, views in made:
            buf[:n].fill_(float(tp_rank() + 1))
            p = Partial(tuple(v[:n].view(1, n) for v in views), handle)
            total, _ = sum_add_norm(p, None, None)
            ok = bool((total == float(world * (world + 1) // 2)).all().item())
            handle.barrier(channel=1)
            if not ok:
                break
    except Exception as e:  # noqa: BLE001
        log.info("deferred sums failed their check: %s", _summary(e))
        ok = False
    if not _ranks_agree(ok, device):
        return False
    _deferred, _deferred_next = made, 0
    return True


def release_deferred_sums() -> None:
    """Drop the deferred-sum buffers (after the CUDA graphs that captured them, before destroy_process_group)."""
    global _deferred
    _deferred = []


def deferred_capacity() -> int:
    """Elements each deferred-sum buffer holds in this process (0: every sum through all_reduce)."""
    return _deferred[0][0].numel() if _deferred else 0


def begin_forward() -> None:
    """A model forward starts: its partial_target calls take the buffers in turn from the first, so a forward (and
    a CUDA graph captured from one) always uses them in the same order."""
    global _deferred_next
    _deferred_next = 0


def end_forward() -> None:
    """A model forward ends: where it deferred sums, a barrier, so that no rank writes the first buffer of the next
    forward while a peer still reads it in this one."""
    if _deferred and _deferred_next > 0:
        _deferred[0][1].barrier(channel=1)


def partial_target(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Partial | None:
    """Where a row-parallel GEMM writes its [rows, cols] share for its consumer to sum (sum_add_norm, reduced):
    the next deferred-sum buffer, or None (sum it with all_reduce) where there is none, it is too small, or the
    dtype differs, or --batch-invariant orders the sums."""
    global _deferred_next
    if tp_size() == 1 or not _deferred or _rank_ordered_sums or device.type != "cuda":
        return None
    buf, handle, views = _deferred[_deferred_next % 2]
    if dtype != buf.dtype or rows * cols > buf.numel():
        return None
    _deferred_next += 1
    return Partial(tuple(v[: rows * cols].view(rows, cols) for v in views), handle)


def sum_add_norm(p: Partial, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float = 1e-6
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum + residual), sum + residual) of a Partial, every rank the same bits (kernels/allreduce_norm.py);
    without `weight`: (sum + residual, the same). A barrier first (not for a sum in place): every rank's share is
    written."""
    from nvcli.kernels.allreduce_norm import sum_add_norm_triton

    if p.handle is not None:
        p.handle.barrier(channel=0)
    return sum_add_norm_triton(p.parts, residual, weight, eps)


def reduced(x: torch.Tensor | Partial) -> torch.Tensor:
    """x summed across the ranks if it is a Partial; else x."""
    return sum_add_norm(x, None, None)[0] if isinstance(x, Partial) else x
