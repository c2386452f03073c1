"""Triton paged attention kernels against the torch references (Triton interpreter on CPU).

Shapes are tiny because the interpreter runs every program in Python.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, on_device

from nvcli.kernels import arrival_counters, decode_attention, prefill_attention
from nvcli.kernels.decode_attention import choose_num_splits
from nvcli.kernels.kv_layout import PagedKV
from nvcli.kernels.reference import paged_attention_ref, paged_decode_attention_ref

paged_decode_attention_triton = on_device(decode_attention.paged_decode_attention_triton)
paged_prefill_attention_triton = on_device(prefill_attention.paged_prefill_attention_triton)

FP8 = torch.float8_e4m3fn
HEAD_DIM = 32
SCALE = HEAD_DIM**-0.5

# the interpreter converts loop bounds with int(ndarray), which numpy >= 1.25 flags
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    block_size: int,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    head_dim: int = HEAD_DIM,
    table_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches and block tables whose blocks are shuffled (non-contiguous) across sequences."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(table_width or 0, max(blocks_per_seq) + 1)
    # padding entries point at a valid block, as the engine's padded tables do
    tables = torch.full((len(seq_lens), width), int(perm[-1]), dtype=torch.int32)
    i = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = perm[i : i + n]
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k_cache, v_cache, tables


def quantize(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 cache, its float32 dequantisation) quantised the way store_kvcache_triton does."""
    q = (cache.float() / scale).clamp(-448.0, 448.0).to(FP8)
    return q, q.float() * scale


def decode_ref(q, k_cache, v_cache, tables, seq_lens) -> torch.Tensor:
    out = paged_decode_attention_ref(q, PagedKV(k_cache, v_cache), tables, seq_lens, SCALE)
    out[seq_lens == 0] = 0.0  # the reference leaves empty rows unset; the kernel writes zeros
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, atol: float = 2e-4, rtol: float = 1e-3) -> None:
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_gqa_block_boundaries(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads * 10 + block_size)
    lens = [15, 16, 17, 31, 32, 33, 1, 0]
    k_cache, v_cache, tables = make_paged_kv(lens, num_kv_heads, block_size, gen)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache), tables, seq_lens, SCALE)
    assert_close(out, decode_ref(q, k_cache, v_cache, tables, seq_lens))
    assert (out[seq_lens == 0] == 0).all()


def test_split_count_keeps_mid_batches_within_one_wave() -> None:
    """132 SMs, 8 KV heads, 4096-token tables: one program per (sequence, KV head) from 66 sequences on; from 17
    to 65 the most splits that fit one wave of 4 programs per SM (never a second, partial wave); small batches
    round up to at least a wave."""
    splits = {n: choose_num_splits(n, 8, 4096, 64, 132) for n in (1, 8, 16, 17, 24, 32, 33, 48, 64, 65, 66, 256)}
    assert splits == {1: 32, 8: 16, 16: 8, 17: 2, 24: 2, 32: 2, 33: 2, 48: 1, 64: 1, 65: 1, 66: 1, 256: 1}
    for n in range(17, 66):
        assert n * 8 * splits.get(n, choose_num_splits(n, 8, 4096, 64, 132)) <= 4 * 132


@pytest.mark.parametrize("num_splits,block_n", [(None, 16), (3, 16), (8, 64)])
def test_decode_splits(num_splits: int | None, block_n: int) -> None:
    """Split-KV paths, including splits that start past a sequence's end and seq_len 0."""
    gen = torch.Generator().manual_seed(7)
    lens = [100, 33, 16, 1, 0]
    # wide padded tables, like a CUDA graph's: the default split count comes from the width
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 16, gen, table_width=16)
    if num_splits is None:
        assert choose_num_splits(len(lens), 2, tables.shape[1] * 16, block_n, 132) > 1
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache), tables, seq_lens, SCALE, num_splits=num_splits,
                                        block_n=block_n)
    assert_close(out, decode_ref(q, k_cache, v_cache, tables, seq_lens))


def test_decode_split_merge() -> None:
    """The in-kernel merge (last split to finish) agrees with the reference, gives the same bits on every call,
    and leaves the arrival counters back at zero (so the next call, or a CUDA-graph replay, starts from a clean
    count)."""
    gen = torch.Generator().manual_seed(17)
    lens = [100, 33, 16, 1, 0, 64]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 16, gen, table_width=8)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(num_splits=4, block_n=16)
    out = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache), tables, seq_lens, SCALE, **kw)
    assert_close(out, decode_ref(q, k_cache, v_cache, tables, seq_lens))
    assert (out[seq_lens == 0] == 0).all()
    again = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache), tables, seq_lens, SCALE, **kw)
    assert torch.equal(out, again)  # deterministic: the merge runs in split order whoever finishes last
    assert arrival_counters.all_zero()


def _dev(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


def _decode_rope_case(seed: int, norm: bool):
    """A decode step for the rotary step inside decode attention: 4 sequences (the last one padding, length 0,
    slot -1), 4 query heads over 2 KV heads: caches, raw qkv rows, positions, slots, the rotary table,
    q/k norm weights (or None), lengths and a function splitting qkv into q, k, v views."""
    from nvcli.models.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    lens = [40, 17, 1, 0]  # lengths after this step's token
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 16, gen)
    heads, kv_heads = 4, 2
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * HEAD_DIM, generator=gen)
    positions = torch.tensor([max(n - 1, 0) for n in lens])
    slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 if n else -1 for i, n in enumerate(lens)])
    rope = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None)
    qw = 1 + 0.1 * torch.randn(HEAD_DIM, generator=gen) if norm else None
    kw = 1 + 0.1 * torch.randn(HEAD_DIM, generator=gen) if norm else None

    def views(t: torch.Tensor):
        q = t[:, : heads * HEAD_DIM].view(-1, heads, HEAD_DIM)
        k = t[:, heads * HEAD_DIM : (heads + kv_heads) * HEAD_DIM].view(-1, kv_heads, HEAD_DIM)
        v = t[:, (heads + kv_heads) * HEAD_DIM :].view(-1, kv_heads, HEAD_DIM)
        return q, k, v

    return k_cache, v_cache, tables, qkv, positions, slots, rope, qw, kw, torch.tensor(lens, dtype=torch.int32), views


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("fp8,num_splits", [(False, 1), (False, 3), (True, 2)])
def test_decode_with_fused_rope(norm: bool, fp8: bool, num_splits: int) -> None:
    """Rotary (+ q/k norm) and the new token's cache store inside the decode kernel give exactly what the
    separate rotary-and-store kernel followed by decode attention gives: same output, same cache bytes
    (a padding row, slot -1 and length 0, writes nothing); every split rotates the raw q for itself."""
    from nvcli.kernels.decode_attention import DecodeRope
    from nvcli.kernels.rotary import rope_qk_norm_triton

    c = _decode_rope_case(29 + norm + 2 * fp8 + num_splits, norm)
    k_cache, v_cache, tables, qkv, positions, slots, rope, qw, kw, seq_lens, views = c
    scales = {}
    if fp8:
        k_cache, _ = quantize(k_cache, 0.01)
        v_cache, _ = quantize(v_cache, 0.02)
        scales = dict(k_scale=0.01, v_scale=0.02)
    ref_qkv, ref_kc, ref_vc = _dev(qkv.clone()), _dev(k_cache.clone()), _dev(v_cache.clone())
    q, k, v = views(ref_qkv)
    rope_qk_norm_triton(q, k, _dev(positions), _dev(rope.cos_sin_cache), _dev(qw), _dev(kw), 1e-6, v=v,
                        kv=PagedKV(ref_kc, ref_vc, **scales), slot_mapping=_dev(slots))
    ref = paged_decode_attention_triton(q, PagedKV(ref_kc, ref_vc, **scales), tables, seq_lens, SCALE,
                                        num_splits=num_splits, block_n=16)

    fused_qkv, kc, vc = _dev(qkv.clone()), _dev(k_cache.clone()), _dev(v_cache.clone())
    q, k, v = views(fused_qkv)
    r = DecodeRope(k, v, _dev(positions), _dev(rope.cos_sin_cache), _dev(slots), _dev(qw), _dev(kw), 1e-6)
    out = paged_decode_attention_triton(q, PagedKV(kc, vc, **scales), tables, seq_lens, SCALE, num_splits=num_splits,
                                        block_n=16, rope=r)
    assert torch.equal(out.cpu(), ref.cpu())
    assert torch.equal(kc.cpu().view(torch.uint8), ref_kc.cpu().view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), ref_vc.cpu().view(torch.uint8))
    assert torch.equal(fused_qkv.cpu(), _dev(qkv).cpu())  # the raw projections are left as they were
    assert not torch.equal(kc.cpu().view(torch.uint8), k_cache.view(torch.uint8))  # the new keys did land

    # programs taking the sequences longest first: the same output and cache bytes
    order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    kc2, vc2 = _dev(k_cache.clone()), _dev(v_cache.clone())
    again = paged_decode_attention_triton(q, PagedKV(kc2, vc2, **scales), tables, seq_lens, SCALE,
                                          num_splits=num_splits, block_n=16, rope=r, order=order)
    assert torch.equal(again.cpu(), ref.cpu())
    assert torch.equal(kc2.cpu().view(torch.uint8), ref_kc.cpu().view(torch.uint8))
    assert torch.equal(vc2.cpu().view(torch.uint8), ref_vc.cpu().view(torch.uint8))


@pytest.mark.parametrize("block_size", [64, 128])
def test_decode_large_pages(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    lens = [block_size + 5, 20]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, block_size, gen)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache), tables, seq_lens, SCALE, num_splits=2)
    assert_close(out, decode_ref(q, k_cache, v_cache, tables, seq_lens))


def test_decode_fp16_strided_q() -> None:
    gen = torch.Generator().manual_seed(3)
    lens = [40, 9]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 16, gen, dtype=torch.float16)
    # q as a strided view of a fused qkv tensor
    qkv = torch.randn(len(lens), 8 * HEAD_DIM, generator=gen).to(torch.float16)
    q = qkv[:, : 4 * HEAD_DIM].view(len(lens), 4, HEAD_DIM)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache), tables, seq_lens, SCALE)
    assert out.dtype == torch.float16
    assert_close(out, decode_ref(q, k_cache, v_cache, tables, seq_lens), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("f16_dot,v_tile", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_decode_fp8_cache(scale_kind: str, f16_dot: bool, v_tile: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    lens = [50, 17, 0]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 16, gen)
    ks, vs = 0.01, 0.02
    k8, k_deq = quantize(k_cache * 2.0, ks)
    v8, v_deq = quantize(v_cache, vs)
    q = torch.randn(len(lens), 8, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if scale_kind == "tensor":
        k_scale, v_scale = torch.tensor([ks]), torch.tensor(vs)
    else:
        k_scale, v_scale = ks, vs
    out = paged_decode_attention_triton(q, PagedKV(k8, v8, k_scale, v_scale), tables, seq_lens, SCALE, num_splits=2,
                                        f16_dot=f16_dot, v_dequant_in_tile=v_tile)
    # fp16 dots (the GPU default for an fp8 cache) round q and the probabilities to fp16
    tol = dict(atol=2e-3, rtol=2e-3) if f16_dot else {}
    assert_close(out, decode_ref(q, k_deq, v_deq, tables, seq_lens), **tol)


@pytest.mark.parametrize("block_size,block_n,num_splits", [(16, 64, 1), (16, 32, 3), (32, 16, 2), (64, 16, 1)])
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_run_addressing(block_size: int, block_n: int, num_splits: int, fp8: bool) -> None:
    """Addresses per run of a page's tokens (the fp8 big-batch loop) read the same K/V as addresses per token,
    with a page split over several tiles (block_n < block_size), partial last tiles and empty splits; V converted
    where it is loaded gives the same output bit for bit (the conversion is exact and the dots are the same)."""
    gen = torch.Generator().manual_seed(block_size * 7 + block_n + num_splits)
    lens = [block_size * 3 + 5, 17, 1, 0, block_size * 2, 130]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, block_size, gen)
    ks = vs = 0.05
    if fp8:
        k_cache, k_deq = quantize(k_cache, ks)
        v_cache, v_deq = quantize(v_cache, vs)
    else:
        k_deq, v_deq = k_cache, v_cache
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(num_splits=num_splits, block_n=block_n, f16_dot=fp8)
    per_token = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache, ks, vs), tables, seq_lens, SCALE,
                                              run_addressing=False, v_dequant_in_tile=False, **kw)
    runs = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache, ks, vs), tables, seq_lens, SCALE,
                                         run_addressing=True, v_dequant_in_tile=fp8, **kw)
    assert torch.equal(runs, per_token)
    assert_close(runs, decode_ref(q, k_deq, v_deq, tables, seq_lens), **(dict(atol=2e-3, rtol=2e-3) if fp8 else {}))


@pytest.mark.parametrize("fp8,num_splits", [(False, 1), (True, 1), (False, 3)])
def test_decode_program_order(fp8: bool, num_splits: int) -> None:
    """`order` only changes which program takes which sequence: any permutation gives the batch-order output bit
    for bit, rows stay in sequence order (not program order), with splits and empty sequences."""
    gen = torch.Generator().manual_seed(41 + fp8 + num_splits)
    lens = [40, 17, 1, 0, 70, 33]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 16, gen)
    scales = (0.05, 0.05) if fp8 else (None, None)
    if fp8:
        k_cache, _ = quantize(k_cache, 0.05)
        v_cache, _ = quantize(v_cache, 0.05)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(num_splits=num_splits, block_n=16)
    base = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache, *scales), tables, seq_lens, SCALE, **kw)
    for order in (torch.argsort(seq_lens, descending=True, stable=True), torch.randperm(len(lens), generator=gen)):
        out = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache, *scales), tables, seq_lens, SCALE,
                                            order=order.to(torch.int32), **kw)
        assert torch.equal(out, base)


# ----------------------------------------------------------------------------- prefill


def _packed(q_lens: list[int], num_heads: int, gen: torch.Generator, dtype=torch.float32):
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), num_heads, HEAD_DIM, generator=gen).to(dtype)
    return q, qsl


def _run_prefill(q, kv: PagedKV, qsl, seq_lens, tables, **kw) -> torch.Tensor:
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    return paged_prefill_attention_triton(q, kv, qsl, seq_lens, tables, max(q_lens), int(seq_lens.max()), SCALE, **kw)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_mixed_batch(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    """Full prompts, prefix-cache hits / chunked prefill (q_len < seq_len) and decodes together."""
    gen = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads * 10 + block_size + 1)
    seq_lens_l = [33, 40, 17, 16, 31, 5]
    q_lens = [33, 24, 1, 16, 1, 3]  # full, prefix hit of 16, decode, full, decode, chunk
    k_cache, v_cache, tables = make_paged_kv(seq_lens_l, num_kv_heads, block_size, gen)
    q, qsl = _packed(q_lens, num_heads, gen)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32)
    out = _run_prefill(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables)
    ref = paged_attention_ref(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables, SCALE)
    assert_close(out, ref)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64)])
def test_prefill_tile_shapes(block_m: int, block_n: int) -> None:
    """Several query blocks per sequence and KV tiles that straddle pages and the diagonal."""
    gen = torch.Generator().manual_seed(block_m + block_n)
    seq_lens_l = [70, 45]
    q_lens = [38, 45]
    k_cache, v_cache, tables = make_paged_kv(seq_lens_l, 2, 16, gen)
    q, qsl = _packed(q_lens, 4, gen)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32)
    out = _run_prefill(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables, block_m=block_m, block_n=block_n)
    ref = paged_attention_ref(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables, SCALE)
    assert_close(out, ref)


def test_prefill_large_pages_and_empty_query() -> None:
    gen = torch.Generator().manual_seed(5)
    seq_lens_l = [70, 9, 20]
    q_lens = [20, 0, 20]  # a sequence without queries this step
    k_cache, v_cache, tables = make_paged_kv(seq_lens_l, 2, 64, gen)
    q, qsl = _packed(q_lens, 4, gen)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32)
    out = _run_prefill(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables)
    ref = paged_attention_ref(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables, SCALE)
    assert_close(out, ref)


def test_prefill_fp16() -> None:
    gen = torch.Generator().manual_seed(9)
    seq_lens_l = [40, 20]
    q_lens = [40, 4]
    k_cache, v_cache, tables = make_paged_kv(seq_lens_l, 2, 16, gen, dtype=torch.float16)
    q, qsl = _packed(q_lens, 4, gen, dtype=torch.float16)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32)
    out = _run_prefill(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables)
    ref = paged_attention_ref(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables, SCALE)
    assert out.dtype == torch.float16
    assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_prefill_fp8_cache() -> None:
    gen = torch.Generator().manual_seed(13)
    seq_lens_l = [40, 18, 7]
    q_lens = [40, 2, 1]
    k_cache, v_cache, tables = make_paged_kv(seq_lens_l, 2, 16, gen)
    ks, vs = 0.02, 0.01
    k8, k_deq = quantize(k_cache, ks)
    v8, v_deq = quantize(v_cache * 3.0, vs)
    q, qsl = _packed(q_lens, 8, gen)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32)
    out = _run_prefill(q, PagedKV(k8, v8, k_scale=torch.tensor(ks), v_scale=vs), qsl, seq_lens, tables)
    ref = paged_attention_ref(q, PagedKV(k_deq, v_deq), qsl, seq_lens, tables, SCALE)
    assert_close(out, ref)


def test_decode_and_prefill_agree_on_decode_batch() -> None:
    """A batch of q_len-1 rows gives the same answer through both kernels."""
    gen = torch.Generator().manual_seed(17)
    lens = [25, 64, 3]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 16, gen)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    dec = paged_decode_attention_triton(q, PagedKV(k_cache, v_cache), tables, seq_lens, SCALE, num_splits=2)
    pre = _run_prefill(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables)
    torch.testing.assert_close(dec, pre, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm,num_splits", [(False, 1), (True, 1), (True, 3)])
def test_decode_with_fused_rope_scales_unnormalized_rows(norm: bool, num_splits: int) -> None:
    """Deferred RMSNorm (models/llama.py): with `scale_rows` the decode kernel's rotary step first multiplies q, k
    and v by each row's 1 / RMS, so attention and the stored K/V are those of the projections of the normalized
    rows (the rows' RMS differ, so a row scaled by another's factor would show)."""
    from nvcli.kernels.decode_attention import DecodeRope
    from nvcli.kernels.rotary import rope_qk_norm_triton
    from nvcli.models.layers.norm import row_rstd

    c = _decode_rope_case(41 + norm + num_splits, norm)
    k_cache, v_cache, tables, qkv, positions, slots, rope, qw, kw, seq_lens, views = c
    # hidden 48, not a power of two: the row loads are masked; the rows' RMS differ 16x
    rows = torch.randn(len(seq_lens), 48, generator=torch.Generator().manual_seed(7))
    rows = rows * torch.tensor([[0.5], [2.0], [8.0], [1.0]])
    ref_qkv, ref_kc, ref_vc = _dev(qkv * row_rstd(rows, 1e-6)), _dev(k_cache.clone()), _dev(v_cache.clone())
    q, k, v = views(ref_qkv)
    rope_qk_norm_triton(q, k, _dev(positions), _dev(rope.cos_sin_cache), _dev(qw), _dev(kw), 1e-6, v=v,
                        kv=PagedKV(ref_kc, ref_vc), slot_mapping=_dev(slots))
    ref = paged_decode_attention_triton(q, PagedKV(ref_kc, ref_vc), tables, seq_lens, SCALE, num_splits=num_splits,
                                        block_n=16)

    kc, vc = _dev(k_cache.clone()), _dev(v_cache.clone())
    q, k, v = views(_dev(qkv.clone()))
    r = DecodeRope(k, v, _dev(positions), _dev(rope.cos_sin_cache), _dev(slots), _dev(qw), _dev(kw), 1e-6,
                   scale_rows=_dev(rows), scale_eps=1e-6)
    out = paged_decode_attention_triton(q, PagedKV(kc, vc), tables, seq_lens, SCALE, num_splits=num_splits,
                                        block_n=16, rope=r)
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc.cpu(), ref_kc.cpu(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(vc.cpu(), ref_vc.cpu(), atol=2e-5, rtol=2e-5)
    assert not torch.allclose(vc.cpu(), v_cache)  # the new (scaled) values did land


@pytest.mark.parametrize("norm", [False, True])
def test_rotary_takes_q_k_and_v_factors_beside_the_row_scale(norm: bool) -> None:
    """A row-scaled FP8 qkv projection whose q, k and v weights kept a scale each (kernels/fp8_rows.py): the row's
    scale (precomputed, [rows]) times q's, k's and v's own factor, in the decode kernel's rotary step and in the
    separate rotary kernel alike: the same as rotating rows scaled beforehand (float32, one rounding each)."""
    from nvcli.kernels.decode_attention import DecodeRope
    from nvcli.kernels.rotary import rope_qk_norm_triton

    k_cache, v_cache, tables, qkv, positions, slots, rope, qw, kw, seq_lens, views = _decode_rope_case(53, norm)
    row = torch.tensor([0.25, 3.0, 0.7, 1.0])
    ratios = torch.tensor([1.0, 0.375, 0.0625])  # q, k, v: v's far from 1 shows in attention and the stored V
    q_cols, kv_cols = 4 * HEAD_DIM, 2 * HEAD_DIM
    cols = ratios.repeat_interleave(torch.tensor([q_cols, kv_cols, kv_cols]))
    pre = _dev(qkv.float() * (row[:, None] * cols[None, :]))
    ref_kc, ref_vc = _dev(k_cache.clone()), _dev(v_cache.clone())
    q, k, v = views(pre)
    rope_qk_norm_triton(q, k, _dev(positions), _dev(rope.cos_sin_cache), _dev(qw), _dev(kw), 1e-6, v=v,
                        kv=PagedKV(ref_kc, ref_vc), slot_mapping=_dev(slots))
    ref = paged_decode_attention_triton(q, PagedKV(ref_kc, ref_vc), tables, seq_lens, SCALE, block_n=16)

    kc, vc = _dev(k_cache.clone()), _dev(v_cache.clone())
    q, k, v = views(_dev(qkv.clone()))
    r = DecodeRope(k, v, _dev(positions), _dev(rope.cos_sin_cache), _dev(slots), _dev(qw), _dev(kw), 1e-6,
                   scale_rows=_dev(row), qkv_ratios=_dev(ratios))
    out = paged_decode_attention_triton(q, PagedKV(kc, vc), tables, seq_lens, SCALE, block_n=16, rope=r)
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc.cpu(), ref_kc.cpu(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(vc.cpu(), ref_vc.cpu(), atol=2e-5, rtol=2e-5)

    kc2, vc2 = _dev(k_cache.clone()), _dev(v_cache.clone())
    q2, k2, v2 = views(_dev(qkv.clone()))
    rope_qk_norm_triton(q2, k2, _dev(positions), _dev(rope.cos_sin_cache), _dev(qw), _dev(kw), 1e-6, v=v2,
                        kv=PagedKV(kc2, vc2), slot_mapping=_dev(slots), scale_rows=_dev(row),
                        qkv_ratios=_dev(ratios))
    q_ref, _, _ = views(pre)
    torch.testing.assert_close(q2.cpu(), q_ref.cpu(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc2.cpu(), ref_kc.cpu(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(vc2.cpu(), ref_vc.cpu(), atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- decode rows beside prompt chunks


@pytest.mark.parametrize("many_decodes", [False, True])
@pytest.mark.parametrize("graph_padding", [False, True])
def test_split_attention_matches_one_pass(graph_padding: bool, many_decodes: bool) -> None:
    """A step with prompt chunks and one-token rows (a long job's steady state): the one-token rows, first, go to
    the decode kernel and the chunks to the prefill kernel, whose query starts begin after them (many_decodes:
    past whole query tiles of the prefill kernel, whose first program ids then own no sequence). As a CUDA graph
    holds it (graph_padding): the decode kernel's capacity reaches into the prompt rows (length 0: it writes zeros
    there first), the prefill kernel sees padding entries (no queries) and the step has padding rows at the end.
    Every real row equals the reference over the whole step."""
    from nvcli.attention.forward import split_attention as paged_split_attention
    from nvcli.attention.metadata import DecodeSplit

    gen = torch.Generator().manual_seed(23)
    if many_decodes:
        seq_lens_l = [3 + 7 * i for i in range(20)] + [8, 20, 3]
        q_lens = [1] * 20 + [8, 5, 3]  # prompt chunks of at most 8 tokens: 8-token query tiles
    else:
        seq_lens_l = [25, 64, 3, 33, 40, 5]
        q_lens = [1, 1, 1, 33, 24, 3]  # three decodes, a full prompt, a chunk after 16 cached tokens, a chunk
    d = q_lens.count(1)
    k_cache, v_cache, tables = make_paged_kv(seq_lens_l, 2, 16, gen)
    q, qsl = _packed(q_lens, 4, gen)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32)
    ref = paged_attention_ref(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables, SCALE)
    num_tokens = q.shape[0]
    d_cap, p_extra, pad_rows = (d + 5, 2, 5) if graph_padding else (d, 0, 0)
    q_in = torch.cat([q, torch.randn(pad_rows, 4, HEAD_DIM, generator=gen)])
    dec_lens = torch.zeros(d_cap, dtype=torch.int32)
    dec_lens[:d] = seq_lens[:d]
    dec_tables = torch.zeros(d_cap, tables.shape[1], dtype=torch.int32)
    dec_tables[:d] = tables[:d]
    order = torch.argsort(-dec_lens, stable=True).to(torch.int32)
    pre_qsl = torch.cat([qsl[d:], torch.full((p_extra,), num_tokens, dtype=torch.int32)])
    pre_lens = torch.cat([seq_lens[d:], torch.zeros(p_extra, dtype=torch.int32)])
    pre_tables = torch.cat([tables[d:], torch.zeros(p_extra, tables.shape[1], dtype=torch.int32)])
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    split = DecodeSplit(d_cap, dev(dec_lens), dev(dec_tables), dev(order), dev(pre_qsl), dev(pre_lens),
                        dev(pre_tables), max(q_lens[d:]))
    out = paged_split_attention(dev(q_in), PagedKV(dev(k_cache), dev(v_cache)), split, SCALE).cpu()
    assert_close(out[:num_tokens], ref)
    # --batch-invariant: the one-token rows take the prefill kernel too, and every row has the bits of one pass
    invariant = paged_split_attention(dev(q_in), PagedKV(dev(k_cache), dev(v_cache)), split, SCALE,
                                      invariant=True).cpu()
    one_pass = _run_prefill(q, PagedKV(k_cache, v_cache), qsl, seq_lens, tables, invariant=True)
    assert torch.equal(invariant[:num_tokens], one_pass)
    assert_close(one_pass, ref)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4)])
def test_prefill_invariant_rows_do_not_depend_on_chunks_or_neighbours(num_heads: int, num_kv_heads: int) -> None:
    """--batch-invariant: a prompt's rows computed as one chunk, as two chunks beside other sequences, or one by one
    as decode rows (each at its own length) give the same bits."""
    gen = torch.Generator().manual_seed(23 + num_kv_heads)
    n = 70
    k_cache, v_cache, tables = make_paged_kv([n, 37, 9], num_kv_heads, 16, gen)
    q = torch.randn(n, num_heads, HEAD_DIM, generator=gen)
    other = torch.randn(12, num_heads, HEAD_DIM, generator=gen)

    def run(q_rows, qsl, lens, seq_tables):
        return _run_prefill(q_rows, PagedKV(k_cache, v_cache), torch.tensor(qsl, dtype=torch.int32),
                            torch.tensor(lens, dtype=torch.int32), seq_tables, invariant=True)

    whole = run(q, [0, n], [n], tables[:1])
    ref = paged_attention_ref(q, PagedKV(k_cache, v_cache), torch.tensor([0, n], dtype=torch.int32),
                              torch.tensor([n], dtype=torch.int32), tables[:1], SCALE)
    assert_close(whole, ref)
    # rows 0-39 first, beside a 3-row chunk of the second sequence; then rows 40-69 after a decode row
    first = run(torch.cat([other[:3], q[:40]]), [0, 3, 43], [37, 40], tables[[1, 0]])[3:]
    second = run(torch.cat([other[3:4], q[40:]]), [0, 1, 31], [9, n], tables[[2, 0]])[1:]
    assert torch.equal(torch.cat([first, second]), whole)
    # every row as a one-token query at its own length
    one_by_one = run(q, list(range(n + 1)), list(range(1, n + 1)), tables[[0] * n])
    assert torch.equal(one_by_one, whole)
