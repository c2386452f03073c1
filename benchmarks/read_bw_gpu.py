"""How fast can the H100 read HBM at all, against decode attention's rate?

    PYTHONPATH=. python3 benchmarks/read_bw_gpu.py [--fp8]

Our figures quote decode attention as a share of the device-to-device copy (read + write bytes
over time). A kernel that only reads may stream faster than a copy; if it does, the gap between it
and decode attention is what attention could still gain. Measured on one 2 GB buffer, median of
CUDA-event timings (triton's do_bench):
- the copy (read + write bytes), torch.sum (read);
- a Triton read kernel over contiguous 16 KB tiles, at several warps / tiles in flight;
- the same kernel reading decode attention's pattern: 256-byte rows (one KV head's row of a
  token) at a 2 KB stride, the layout of a 16-token bf16 page with 8 KV heads, each program one
  head;
- decode attention's reads alone on the workload's paged KV (256 x ~880 tokens, 16-token bf16 pages, gathered
  through the block table): per (KV head, sequence) program, from a persistent grid, with equal lengths, with
  pages contiguous per sequence;
- decode attention itself on the same KV, at several tile configs and splits, KV bytes over time.
With --fp8 only: the engine's fp8 pages (32 tokens, V dims-major) read as raw bytes a page at a time, against
the fp8 decode kernel with and without its rotary step, at 256 x ~880 and 128 x ~1,090.
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl
import triton.testing
from decode_variants import workload_lens
from kernels import paged_kv

from nvcli.kernels.decode_attention import paged_decode_attention_triton


@triton.jit
def _read_kernel(x_ptr, out_ptr, rows_per_prog, ROW: tl.constexpr, STRIDE: tl.constexpr, HEADS: tl.constexpr,
                 TILE: tl.constexpr):
    """Program p sums `rows_per_prog` rows of ROW elements; rows are STRIDE apart, and program p reads head
    p % HEADS of its group (STRIDE = ROW * HEADS: a KV page's head rows; HEADS 1: contiguous)."""
    p = tl.program_id(0)
    head = p % HEADS
    base = x_ptr + (p // HEADS).to(tl.int64) * rows_per_prog * STRIDE + head * ROW
    offs = tl.arange(0, TILE)[:, None] * STRIDE + tl.arange(0, ROW)[None, :]
    acc = tl.zeros([TILE, ROW], dtype=tl.float32)
    for r in range(0, rows_per_prog, TILE):
        acc += tl.load(base + r * STRIDE + offs).to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc))


@triton.jit
def _sum_kv_rows(acc, k_ptr, v_ptr, bt_row, kvh, start, end, stride_kb, stride_kt, stride_kh, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """acc + the K and V rows of head kvh at positions [start, end) of one sequence, gathered through its block
    table row a BLOCK_N-token tile at a time (decode attention's loads, without its arithmetic)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for t in range(start, end, BLOCK_N):
        pos = t + offs_n
        mask = pos < end
        blk = tl.load(bt_row + pos // PAGE, mask=mask, other=0).to(tl.int64)
        off = (blk * stride_kb + (pos % PAGE) * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :]
        acc += tl.load(k_ptr + off, mask=mask[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + off, mask=mask[:, None], other=0.0).to(tl.float32)
    return acc


@triton.jit
def _paged_read_kernel(k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, out_ptr, stride_bt, stride_kb, stride_kt,
                       stride_kh, num_splits, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Decode attention's reads and nothing else: program (kvh, row, split) sums the K and V rows of head kvh of
    sequence order[row] over its split, gathered through the block table a BLOCK_N-token tile at a time."""
    kvh = tl.program_id(0)
    seq = tl.load(order_ptr + tl.program_id(1))
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    acc = _sum_kv_rows(tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32), k_ptr, v_ptr, bt_row, kvh, start, end,
                       stride_kb, stride_kt, stride_kh, PAGE, BLOCK_N, HEAD_DIM)
    tl.store(out_ptr + (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + kvh,
             tl.sum(acc))


@triton.jit
def _persistent_paged_read_kernel(k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, out_ptr, num_items, stride_bt,
                                  stride_kb, stride_kt, stride_kh, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The same reads from a persistent grid: program p takes work items p, p + P, ... of the (row, KV head) items
    in longest-first order, so no program starts late and the slots stay busy to the end."""
    acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        kvh = item % NUM_KV_HEADS
        seq = tl.load(order_ptr + item // NUM_KV_HEADS)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        acc = _sum_kv_rows(acc, k_ptr, v_ptr, bt_row, kvh, 0, tl.load(lens_ptr + seq), stride_kb, stride_kt,
                           stride_kh, PAGE, BLOCK_N, HEAD_DIM)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _fp8_page_read_kernel(k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, out_ptr, stride_bt, stride_kb, stride_vb,
                          stride_vh, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    """The engine's fp8 pages as raw bytes, a page at a time: program (kvh, row) sums head kvh of sequence
    order[row], K rows of HEAD_DIM bytes at a (heads * HEAD_DIM)-byte stride, V one [HEAD_DIM, PAGE] block per
    page (dims-major); whole pages, as decode attention reads them."""
    kvh = tl.program_id(0)
    seq = tl.load(order_ptr + tl.program_id(1))
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    offs_t = tl.arange(0, PAGE)
    offs_d = tl.arange(0, HEAD_DIM)
    k_tile = offs_t[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + offs_d[None, :]  # [PAGE, HEAD_DIM]
    v_tile = kvh * stride_vh + offs_d[:, None] * PAGE + offs_t[None, :]  # [HEAD_DIM, PAGE]
    acc_k = tl.zeros([PAGE, HEAD_DIM], dtype=tl.int32)
    acc_v = tl.zeros([HEAD_DIM, PAGE], dtype=tl.int32)
    for page in range(0, tl.cdiv(tl.load(lens_ptr + seq), PAGE)):
        blk = tl.load(bt_row + page).to(tl.int64)
        acc_k += tl.load(k_ptr + blk * stride_kb + k_tile).to(tl.int32)
        acc_v += tl.load(v_ptr + blk * stride_vb + v_tile).to(tl.int32)
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + kvh, tl.sum(acc_k) + tl.sum(acc_v))


def fp8_rows(dev: str) -> list[tuple[str, float]]:
    """The engine's fp8 decode attention (32-token pages, V dims-major) against a read of the same pages."""
    from decode_variants import engine_decode_step

    from nvcli.models.layers.rotary import RotaryEmbedding

    cos_sin = RotaryEmbedding(128, 4096, 1e6, None).cos_sin_cache.to(dev)
    norm_w = torch.ones(128, device=dev, dtype=torch.bfloat16)
    scales = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
    out = torch.empty(1 << 16, device=dev, dtype=torch.int32)
    rows = []
    for num_seqs, step in [(256, 300), (128, 500)]:
        lens = workload_lens(num_seqs, step, 1)
        sl, kc, vc, bt, q, rope = engine_decode_step(lens, dev, cos_sin, norm_w)
        order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
        kv_bytes = 2 * sum(lens) * 8 * 128
        shape = f"{num_seqs} x ~{sum(lens) // num_seqs}"
        kb_, vb_ = kc.view(torch.uint8), vc.view(torch.uint8)
        for warps, stages in [(4, 2), (4, 3), (8, 2), (8, 3)]:
            def run(warps=warps, stages=stages, kb_=kb_, vb_=vb_, bt=bt, sl=sl, order=order, num_seqs=num_seqs):
                _fp8_page_read_kernel[(8, num_seqs)](kb_, vb_, bt, sl, order, out, bt.stride(0), kb_.stride(0),
                                                     vb_.stride(0), vb_.stride(2), PAGE=32, HEAD_DIM=128,
                                                     NUM_KV_HEADS=8, num_warps=warps, num_stages=stages)
            t = ms(run)
            rows.append((f"fp8 pages read, {shape}, {warps} warps, {stages} stages, {t * 1e3:.0f} us", kv_bytes / t / 1e9))
            print(rows[-1], flush=True)
        for name, kw in [("no rotary", {}), ("rotary (the engine's kernel)", {"rope": rope})]:
            t = ms(functools.partial(paged_decode_attention_triton, q, kc, vc, bt, sl, 128**-0.5, *scales, order=order,
                                     **kw))
            rows.append((f"fp8 decode attention, {shape}, {name}, {t * 1e3:.0f} us", kv_bytes / t / 1e9))
            print(rows[-1], flush=True)
    return rows


def ms(fn) -> float:
    """Median milliseconds per call (so bytes / ms / 1e9 is TB/s)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> int:
    dev = "cuda"
    if "--fp8" in sys.argv:
        rows = fp8_rows(dev)
        print("\n| what | TB/s |\n| --- | --- |")
        for label, tbs in rows:
            print(f"| {label} | {tbs:.3f} |")
        return 0
    n = 1 << 30  # 2 GB of bf16
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    nbytes = x.numel() * 2
    rows = []
    y = torch.empty_like(x)
    t = ms(lambda: y.copy_(x))
    y = None  # free it for the KV cache below
    rows.append(("copy (read + write bytes)", 2 * nbytes / t / 1e9))
    t = ms(lambda: x.sum())
    rows.append(("torch.sum", nbytes / t / 1e9))
    out = torch.empty(1 << 20, device=dev, dtype=torch.float32)
    for label, row, heads in [("contiguous 256 B rows", 128, 1), ("KV pattern: 256 B rows at 2 KB stride", 128, 8)]:
        stride = row * heads
        for progs_per_sm in [4, 8, 16, 32]:
            for warps, tile in [(4, 32), (4, 64), (8, 64)]:
                programs = 132 * progs_per_sm
                programs -= programs % heads
                rows_per_prog = (n // (programs // heads) // stride) // tile * tile
                read = programs // heads * rows_per_prog * stride * 2

                def run(programs=programs, rows_per_prog=rows_per_prog, row=row, stride=stride, heads=heads,
                        tile=tile, warps=warps):
                    _read_kernel[(programs,)](x, out, rows_per_prog, ROW=row, STRIDE=stride, HEADS=heads,
                                              TILE=tile, num_warps=warps)
                t = ms(run)
                rows.append((f"{label}, {progs_per_sm} programs/SM, {warps} warps, {tile}-row tiles", read / t / 1e9))
                print(rows[-1], flush=True)
    lens = workload_lens(256, 300, 1)
    k, v, bt = paged_kv(lens, 8, 128, 16, torch.bfloat16, dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
    q = torch.randn(256, 16, 128, device=dev, dtype=torch.bfloat16)
    kv_bytes = 2 * sum(lens) * 8 * 128 * 2
    batch_order = torch.arange(256, dtype=torch.int32, device=dev)
    for splits in [1, 2]:
        for warps, stages in [(4, 2), (4, 3), (8, 2), (8, 3)]:
            for name, o in [("longest first", order), ("batch order", batch_order)]:
                def run(splits=splits, warps=warps, stages=stages, o=o):
                    _paged_read_kernel[(8, 256, splits)](k, v, bt, sl, o, out, bt.stride(0), k.stride(0), k.stride(1),
                                                         k.stride(2), splits, PAGE=16, BLOCK_N=64, HEAD_DIM=128,
                                                         num_warps=warps, num_stages=stages)
                t = ms(run)
                rows.append((f"paged read of the same KV, {splits} split(s), {warps} warps, {stages} stages, {name}, "
                             f"{t * 1e3:.0f} us", kv_bytes / t / 1e9))
                print(rows[-1], flush=True)
    for per_sm in [2, 3, 4, 6]:
        for warps in [4, 8]:
            def run(per_sm=per_sm, warps=warps):
                _persistent_paged_read_kernel[(132 * per_sm,)](k, v, bt, sl, order, out, 256 * 8, bt.stride(0),
                                                               k.stride(0), k.stride(1), k.stride(2), NUM_KV_HEADS=8,
                                                               PAGE=16, BLOCK_N=64, HEAD_DIM=128, num_warps=warps,
                                                               num_stages=2)
            t = ms(run)
            rows.append((f"persistent paged read, {per_sm} programs/SM, {warps} warps, {t * 1e3:.0f} us",
                         kv_bytes / t / 1e9))
            print(rows[-1], flush=True)
    equal = [sum(lens) // 256] * 256
    ke, ve, bte = paged_kv(equal, 8, 128, 16, torch.bfloat16, dev)
    sle = torch.tensor(equal, dtype=torch.int32, device=dev)
    contiguous = bt.clone()
    first = 0
    for i, n in enumerate(lens):
        pages = -(-n // 16)
        contiguous[i, :pages] = torch.arange(first, first + pages, dtype=torch.int32, device=dev)
        first += pages
    for name, kk, vv, tables, lengths in [("equal lengths", ke, ve, bte, sle), ("contiguous pages", k, v, contiguous, sl)]:
        nbytes = 2 * int(lengths.sum()) * 8 * 128 * 2

        def run(kk=kk, vv=vv, tables=tables, lengths=lengths):
            _paged_read_kernel[(8, 256, 1)](kk, vv, tables, lengths, order, out, tables.stride(0), kk.stride(0),
                                            kk.stride(1), kk.stride(2), 1, PAGE=16, BLOCK_N=64, HEAD_DIM=128,
                                            num_warps=4, num_stages=2)
        t = ms(run)
        rows.append((f"paged read, {name}, 4 warps, 2 stages, {t * 1e3:.0f} us", nbytes / t / 1e9))
        t = ms(functools.partial(paged_decode_attention_triton, q, kk, vv, tables, lengths, 128**-0.5, order=order))
        rows.append((f"decode attention, {name}, {t * 1e3:.0f} us", nbytes / t / 1e9))
    del ke, ve
    for splits in [2, 4]:
        t = ms(functools.partial(paged_decode_attention_triton, q, k, v, bt, sl, 128**-0.5, order=order,
                                 num_splits=splits))
        rows.append((f"decode attention 256 x ~880, default, {splits} splits, {t * 1e3:.0f} us", kv_bytes / t / 1e9))
    for block_n, warps, stages in [(None, None, None), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 4, 2), (128, 8, 2),
                                   (128, 8, 3), (32, 4, 3), (32, 4, 4)]:
        t = ms(functools.partial(paged_decode_attention_triton, q, k, v, bt, sl, 128**-0.5, order=order,
                                 block_n=block_n, num_warps=warps, num_stages=stages))
        cfg = "default (64 / 4 / 2)" if block_n is None else f"{block_n} / {warps} / {stages}"
        rows.append((f"decode attention 256 x ~880, {cfg}, {t * 1e3:.0f} us", kv_bytes / t / 1e9))
        print(rows[-1], flush=True)
    print("\n| what | TB/s |\n| --- | --- |")
    for label, tbs in rows:
        print(f"| {label} | {tbs:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
