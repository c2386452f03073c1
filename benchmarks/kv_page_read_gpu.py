"""Can decode attention's KV reads get closer to a streaming read? Whole pages and TMA against the row gather.

    PYTHONPATH=. python3 benchmarks/kv_page_read_gpu.py

Session 15 (RESULTS.md) measured the H100 streaming 3.07-3.09 TB/s, a read of the workload's paged KV the way decode
attention reads it 2.92-2.94 TB/s, and decode attention 2.87-2.89. What separates the paged read from the stream was
put down to the gather: each program takes one KV head of one sequence, so every 16-token page is read as 16 rows of
256 bytes at a 2 KB stride, one page address per run. This probe reads the same KV (256 sequences x ~880 tokens,
16-token bf16 pages, 8 KV heads of 128, shuffled blocks, longest first) in other ways, reads only (each program sums
what it loads):
- `rows`: the engine's pattern (session 15's `read_bw_gpu._paged_read_kernel`), the reference;
- `pages`: a program takes all KV heads of a share of one sequence's pages, so every load is a whole page, 32 KB
  contiguous, through ordinary loads;
- `tma head`: the engine's program shape, each page's head rows fetched by one TMA copy (a [16, 1, 128] box);
- `tma pages`: whole pages by TMA ([16, 8, 128] boxes), Triton's pipeliner keeping `stages` copies in flight.
TB/s = KV bytes read / median time (triton's do_bench). The last table is printed last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from decode_variants import workload_lens
from kernels import paged_kv
from read_bw_gpu import _paged_read_kernel, ms
from triton.tools.tensor_descriptor import TensorDescriptor

from nvcli.kernels.decode_attention import paged_decode_attention_triton

PAGE, HEADS, DIM = 16, 8, 128


@triton.jit
def _pages_kernel(k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, out_ptr, stride_bt, PAGE: tl.constexpr,
                  HEADS: tl.constexpr, DIM: tl.constexpr):
    """Program (split, row): whole pages (all heads, 32 KB each of K and V) of its share of sequence order[row]."""
    split = tl.program_id(0)
    seq = tl.load(order_ptr + tl.program_id(1))
    pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE)
    per = tl.cdiv(pages, tl.num_programs(0))
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    offs = tl.arange(0, PAGE)[:, None] * (HEADS * DIM) + tl.arange(0, HEADS * DIM)[None, :]
    acc = tl.zeros([HEADS * DIM], dtype=tl.float32)
    for p in range(split * per, tl.minimum(pages, split * per + per)):
        blk = tl.load(bt_row + p).to(tl.int64) * (PAGE * HEADS * DIM)
        acc += tl.sum(tl.load(k_ptr + blk + offs).to(tl.float32), axis=0)
        acc += tl.sum(tl.load(v_ptr + blk + offs).to(tl.float32), axis=0)
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + split, tl.sum(acc))


@triton.jit
def _tma_head_kernel(k_desc, v_desc, bt_ptr, lens_ptr, order_ptr, out_ptr, stride_bt, STAGES: tl.constexpr,
                     PAGE: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr):
    """Program (kvh, row) as in `rows`, each page's [PAGE, 1, DIM] head box one TMA copy."""
    kvh = tl.program_id(0)
    seq = tl.load(order_ptr + tl.program_id(1))
    pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([PAGE, 1, DIM], dtype=tl.float32)
    for p in tl.range(0, pages, num_stages=STAGES):
        row = tl.load(bt_row + p) * PAGE
        acc += k_desc.load([row, kvh, 0]).to(tl.float32)
        acc += v_desc.load([row, kvh, 0]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(1) * HEADS + kvh, tl.sum(acc))


@triton.jit
def _tma_pages_kernel(k_desc, v_desc, bt_ptr, lens_ptr, order_ptr, out_ptr, stride_bt, STAGES: tl.constexpr,
                      PAGE: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr):
    """Program (split, row) as in `pages`, each whole [PAGE, HEADS, DIM] page one TMA copy."""
    split = tl.program_id(0)
    seq = tl.load(order_ptr + tl.program_id(1))
    pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE)
    per = tl.cdiv(pages, tl.num_programs(0))
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([HEADS, DIM], dtype=tl.float32)
    for p in tl.range(split * per, tl.minimum(pages, split * per + per), num_stages=STAGES):
        row = tl.load(bt_row + p) * PAGE
        acc += tl.sum(k_desc.load([row, 0, 0]).to(tl.float32), axis=0)
        acc += tl.sum(v_desc.load([row, 0, 0]).to(tl.float32), axis=0)
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + split, tl.sum(acc))


def main() -> int:
    dev = "cuda"
    rows: list[tuple[str, float]] = []

    def record(label: str, nbytes: int, t: float) -> None:
        rows.append((f"{label}, {t * 1e3:.0f} us", nbytes / t / 1e9))
        print(rows[-1], flush=True)

    stream = torch.randn(1 << 30, device=dev, dtype=torch.bfloat16)
    record("torch.sum over 2 GB (streaming read)", stream.numel() * 2, ms(stream.sum))
    stream = None  # free it for the KV cache
    lens = workload_lens(256, 300, 1)
    n = len(lens)
    k, v, bt = paged_kv(lens, HEADS, DIM, PAGE, torch.bfloat16, dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
    kv_bytes = 2 * sum(lens) * HEADS * DIM * 2
    page_bytes = 2 * sum(-(-x // PAGE) * PAGE for x in lens) * HEADS * DIM * 2  # whole pages
    out = torch.empty(1 << 16, device=dev, dtype=torch.float32)
    q = torch.randn(n, 2 * HEADS, DIM, device=dev, dtype=torch.bfloat16)
    record("decode attention, the engine's kernel (default config)", kv_bytes,
           ms(lambda: paged_decode_attention_triton(q, k, v, bt, sl, DIM**-0.5, order=order)))
    for warps, stages in [(4, 2), (4, 3)]:  # session 15's kernel for the engine's pattern
        record(f"rows (engine pattern), 64-token tiles, {warps} warps, {stages} stages", kv_bytes, ms(
            lambda w=warps, s=stages: _paged_read_kernel[(HEADS, n, 1)](k, v, bt, sl, order, out, bt.stride(0),
                                                                        k.stride(0), k.stride(1), k.stride(2), 1,
                                                                        PAGE=PAGE, BLOCK_N=64, HEAD_DIM=DIM,
                                                                        num_warps=w, num_stages=s)))
    for splits in [2, 4, 8]:
        for warps, stages in [(4, 2), (8, 2), (8, 3)]:
            record(f"pages, {splits} splits, {warps} warps, {stages} stages", page_bytes, ms(
                lambda sp=splits, w=warps, s=stages: _pages_kernel[(sp, n)](k, v, bt, sl, order, out, bt.stride(0),
                                                                           PAGE=PAGE, HEADS=HEADS, DIM=DIM,
                                                                           num_warps=w, num_stages=s)))
    k3, v3 = k.view(-1, HEADS, DIM), v.view(-1, HEADS, DIM)
    head_k = TensorDescriptor.from_tensor(k3, [PAGE, 1, DIM])
    head_v = TensorDescriptor.from_tensor(v3, [PAGE, 1, DIM])
    for warps, stages in [(1, 4), (2, 4), (4, 4), (4, 6), (4, 8)]:
        try:
            record(f"tma head, {warps} warps, {stages} stages", page_bytes, ms(
                lambda w=warps, s=stages: _tma_head_kernel[(HEADS, n)](head_k, head_v, bt, sl, order, out,
                                                                      bt.stride(0), STAGES=s, PAGE=PAGE, HEADS=HEADS,
                                                                      DIM=DIM, num_warps=w)))
        except Exception as e:  # a config the compiler refuses (shared memory) is a row, not the end of the probe
            rows.append((f"tma head, {warps} warps, {stages} stages: {type(e).__name__} {str(e)[:80]}", 0.0))
    page_k = TensorDescriptor.from_tensor(k3, [PAGE, HEADS, DIM])
    page_v = TensorDescriptor.from_tensor(v3, [PAGE, HEADS, DIM])
    for splits in [2, 4, 8]:
        for warps, stages in [(4, 2), (4, 3), (8, 3)]:
            try:
                record(f"tma pages, {splits} splits, {warps} warps, {stages} stages", page_bytes, ms(
                    lambda sp=splits, w=warps, s=stages: _tma_pages_kernel[(sp, n)](
                        page_k, page_v, bt, sl, order, out, bt.stride(0), STAGES=s, PAGE=PAGE, HEADS=HEADS, DIM=DIM,
                        num_warps=w)))
            except Exception as e:
                rows.append((f"tma pages, {splits} splits, {warps} warps, {stages} stages: {type(e).__name__} "
                             f"{str(e)[:80]}", 0.0))
    print("\n| what (256 x ~880 tokens, bf16, 16-token pages) | TB/s |\n| --- | --- |")
    for label, tbs in rows:
        print(f"| {label} | {tbs:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
