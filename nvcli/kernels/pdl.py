"""Programmatic dependent launch (PDL, Hopper and later) for the small-batch decode chain.

A kernel launched with PDL may start while the kernel before it in the stream is still running:
its programs become resident, do what does not depend on that kernel (the skinny GEMM loads its
first weight tile) and then block in `griddepcontrol.wait` until the previous kernel has finished
and its writes are visible. Decoding a handful of sequences runs ~10 kernels of a few microseconds
per layer, so the launch and memory latency hidden this way is a large share of a token's time.

Every PDL kernel keeps two rules: before the wait it reads nothing an earlier kernel of the step
writes (only weights, rotary tables and the step's copied-in inputs) and stores nothing. It also
signals `launch_dependents` first thing, so the next kernel can be scheduled early. Before waiting,
the skinny GEMM and decode attention also prefetch what they will read into L2 (`prefetch_l2`: the
weight share, the KV lines) so those bytes stream while the previous kernel runs; a prefetch is a
hint into the coherent L2, never a read into registers, so it may touch lines a kernel still writes.
A kernel that is not PDL-aware (cuBLAS, torch) simply ends the overlap: the next launch waits for it
as usual.

Only launches with at most MAX_ROWS rows use it (a decision from shapes, so CUDA graphs capture
it). Below that bound it takes one request from about 1.14 to 1.06 ms per token on the H100; past it,
with cuBLAS GEMMs between the kernels, it measured within noise (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MAX_ROWS = 16
# Decode attention prefetches a program's whole KV share; past 16 sequences the
# first wave's shares outgrow the 50 MB L2 and would evict each other before they are read.
L2_PREFETCH_MAX_SEQS = 16


@cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor, rows: int) -> bool:
    """Whether a kernel over `rows` rows of `t` should be launched with PDL."""
    if not (t.is_cuda and rows <= MAX_ROWS):
        return False
    return _hopper_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_kwargs(pdl: bool) -> dict:
    """Extra launch options for a Triton kernel (none unless PDL: the interpreter knows no such option)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First thing in a PDL kernel that reads its inputs at once: let the next kernel launch, then
    wait for the previous one (both are no-ops when PDL is off)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """`prefetch.global.L2` of the 128-byte line at each pointer: no registers held, no result; the
    data is in L2 when the kernel's real loads ask for it. PDL kernels issue it for their weights (and
    decode attention for its KV lines) before `griddepcontrol.wait`, so those bytes stream from HBM
    while the previous kernel is still running. L2 is coherent, so a prefetched line is never stale."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
