"""Dims-major V pages (kv_layout.py): every kernel that writes or reads a V cache gives with a dims-major
cache exactly what it gives with a token-major cache holding the same values. In a dims-major cache the full
pages are dims-major and each sequence's open (last, partial) page is token-major; stores write token-major and
the pages a step fills are sealed."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, on_device
from test_attention_kernels import FP8, HEAD_DIM, SCALE, _packed, make_paged_kv, quantize

from nvcli.kernels import decode_attention, kv_store, prefill_attention
from nvcli.kernels.kv_layout import (
    PagedKV,
    allocate_kv_cache,
    is_dims_major,
    open_page_view,
    page_view,
    v_dims_major,
)
from nvcli.kernels.reference import paged_attention_ref, quantize_kv, seal_pages_ref, store_kvcache_ref

paged_decode_attention_triton = on_device(decode_attention.paged_decode_attention_triton)
paged_prefill_attention_triton = on_device(prefill_attention.paged_prefill_attention_triton)
store_kvcache_triton = on_device(kv_store.store_kvcache_triton)
seal_pages_triton = on_device(kv_store.seal_pages_triton)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def dims_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same values in a dims-major page view."""
    nb, bs, h, d = cache.shape
    view = page_view(torch.empty(nb, bs * h * d, dtype=cache.dtype), bs, h, d, dims_major=True)
    view.copy_(cache)
    return view


def engine_layout(v: torch.Tensor, tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """A token-major cache's values as the engine keeps them in a dims-major cache: full pages dims-major, the
    open page of each sequence of length `lens[i]` token-major."""
    out = dims_major_copy(v)
    bs = v.shape[1]
    for row, n in enumerate(lens):
        if n % bs:
            block = int(tables[row, n // bs])
            open_page_view(out)[block] = v[block]
    return out


def logical_values(v_dm: torch.Tensor, tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """engine_layout's inverse: the values a dims-major cache holds, as a token-major tensor."""
    out = v_dm.contiguous()
    bs = v_dm.shape[1]
    for row, n in enumerate(lens):
        if n % bs:
            block = int(tables[row, n // bs])
            out[block] = open_page_view(v_dm)[block]
    return out


def test_which_caches_are_dims_major() -> None:
    assert v_dims_major(FP8, 32)  # 32 one-byte tokens: one 32-byte sector per (head, dim) row
    assert not v_dims_major(FP8, 16) and not v_dims_major(FP8, 64)
    assert not v_dims_major(torch.bfloat16, 16) and not v_dims_major(torch.bfloat16, 32)


def test_allocated_views_address_their_storage() -> None:
    storage, caches = allocate_kv_cache(2, 3, 32, 2, 16, FP8, "cpu", scale=0.25)
    assert storage.shape == (2, 2, 3, 32 * 2 * 16) and len(caches) == 2
    kv = caches[1]
    k, v = kv.k, kv.v
    assert k.shape == v.shape == (3, 32, 2, 16)
    assert not is_dims_major(k) and is_dims_major(v)
    assert (kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim, kv.dtype) == (3, 32, 2, 16, FP8)
    assert kv.fp8 and kv.v_dims_major
    # the strides the kernels take: K (block, token, head), V (block, token, head, dim); stores address V's open page
    assert kv.strides == (*k.stride()[:3], *v.stride()) == (1024, 32, 16, 1024, 1, 512, 32)
    assert kv.store_strides == (*k.stride()[:3], *open_page_view(v).stride()) == (1024, 32, 16, 1024, 16, 512, 1)
    # each layer its own [1] float32 scales, set to the cache's scale
    for s in (kv.k_scale, kv.v_scale, caches[0].k_scale):
        assert isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.tolist() == [0.25]
    assert kv.k_scale is not caches[0].k_scale and kv.k_scale is not kv.v_scale
    v[2, 5, 1, 7] = 3.0  # block 2, token 5, head 1, dim 7
    assert storage[1, 1, 2].view(2, 16, 32)[1, 7, 5].item() == 3.0  # [head, dim, token] in storage
    k[0, 1, 0, 3] = 2.0
    assert storage[0, 1, 0].view(32, 2, 16)[1, 0, 3].item() == 2.0
    open_page_view(v)[1, 5, 1, 7] = 4.0  # an open page: [head, token, dim] in the same bytes
    assert storage[1, 1, 1].view(2, 32, 16)[1, 5, 7].item() == 4.0
    assert open_page_view(k) is k
    _, (kv16,) = allocate_kv_cache(1, 2, 16, 2, 16, FP8, "cpu")
    assert not is_dims_major(kv16.v) and kv16.v.is_contiguous() and not kv16.v_dims_major and kv16.v_open is kv16.v
    assert kv16.strides == kv16.store_strides == (*kv16.k.stride()[:3], *kv16.v.stride())
    with pytest.raises(AssertionError, match="neither token-major nor dims-major"):
        is_dims_major(torch.zeros(3, 2, 16, 32).permute(0, 3, 2, 1))  # [block, token, head, dim] from [b, d, h, t]


@pytest.mark.parametrize("store", ["triton", "reference"])
def test_store_writes_token_major_rows(store: str) -> None:
    """A store into a dims-major V cache writes each token's V as a token-major row (its open page's layout): the
    bytes are those of the same store into a token-major cache, NaN stored as 0 (the kernels' whole-run V loads
    rely on no slot holding a NaN)."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, heads, blocks, bs = 11, 2, 3, 32
    # values representable after the division (the interpreter's fp32->fp8 cast mis-rounds some others, see
    # test_kv_store.py), one NaN
    codes = torch.randint(0, 256, (2, num_tokens, heads, HEAD_DIM), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    key, value = codes.view(FP8).float()[0] * 0.5, codes.view(FP8).float()[1] * 0.25
    value[4, 1, 9] = float("nan")
    slots = torch.randperm(blocks * bs, generator=gen)[:num_tokens]
    slots[2] = -1
    fn = store_kvcache_triton if store == "triton" else store_kvcache_ref
    k_flat = torch.zeros(blocks, bs, heads, HEAD_DIM, dtype=FP8)
    v_flat = torch.zeros_like(k_flat)
    k_dm, v_dm = torch.zeros_like(k_flat), dims_major_copy(torch.zeros_like(k_flat))
    fn(key, value, PagedKV(k_flat, v_flat, 0.5, 0.25), slots)
    fn(key, value, PagedKV(k_dm, v_dm, 0.5, 0.25), slots)
    assert torch.equal(open_page_view(v_dm).contiguous().view(torch.uint8), v_flat.view(torch.uint8))
    assert torch.equal(k_dm.view(torch.uint8), k_flat.view(torch.uint8))
    slot = int(slots[4])
    assert open_page_view(v_dm)[slot // bs, slot % bs, 1, 9].float().item() == 0.0  # the NaN
    assert torch.equal(v_flat.view(torch.uint8)[slot // bs, slot % bs, 0],
                       quantize_kv(value[4, 0], FP8, 0.25).view(torch.uint8))
    assert not torch.isnan(v_dm.float()).any()


@pytest.mark.parametrize("seal", ["triton", "reference"])
def test_seal_turns_filled_pages_dims_major(seal: str) -> None:
    """Sealing transposes, in place, the pages whose last slot is named: their dims-major view then reads what
    their open view read. Other slots (and -1) name no page, other pages keep their bytes."""
    gen = torch.Generator().manual_seed(5)
    blocks, bs, heads = 5, 32, 2
    codes = torch.randint(0, 256, (blocks, bs * heads * HEAD_DIM), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    v = page_view(codes.view(FP8), bs, heads, HEAD_DIM, dims_major=True)
    before_open = open_page_view(v).contiguous()
    before = codes.clone()
    slots = torch.tensor([3 * bs + bs - 1, -1, 1 * bs + 7, 0 * bs + bs - 1, 4 * bs])  # seals blocks 3 and 0
    (seal_pages_triton if seal == "triton" else seal_pages_ref)(PagedKV(torch.zeros_like(before_open), v), slots)
    for block in range(blocks):
        if block in (0, 3):
            assert torch.equal(v[block].contiguous().view(torch.uint8), before_open[block].view(torch.uint8))
        else:
            assert torch.equal(codes[block], before[block])


@pytest.mark.parametrize("ops_path", ["triton", "reference"])
def test_chunks_and_decode_steps_keep_the_engine_layout(ops_path: str) -> None:
    """Store + seal step after step, as the attention layer runs them: a prompt in two chunks (the second one
    fills the page the first left open), then decode tokens, one of which fills a page. After every step the
    cache holds the token-major cache's values in the engine layout."""
    gen = torch.Generator().manual_seed(9)
    heads, bs = 2, 32
    table = torch.tensor([[4, 0, 2, 5]], dtype=torch.int32)
    k_tm = torch.zeros(6, bs, heads, HEAD_DIM, dtype=FP8)
    v_tm, k_dm, v_dm = torch.zeros_like(k_tm), torch.zeros_like(k_tm), dims_major_copy(torch.zeros_like(k_tm))
    store = store_kvcache_triton if ops_path == "triton" else store_kvcache_ref
    seal = seal_pages_triton if ops_path == "triton" else seal_pages_ref
    done = 0
    for end in (45, 70, 71, 95, 96, 97):  # chunk, chunk, decode steps (96: the token at 95 fills page 2)
        pos = torch.arange(done, end)
        slots = table[0, pos // bs].long() * bs + pos % bs
        codes = torch.randint(0, 126, (2, len(pos), heads, HEAD_DIM), generator=gen, dtype=torch.uint8)
        k, v = codes.view(FP8).float()[0], codes.view(FP8).float()[1]
        for vc, kc in ((v_tm, k_tm), (v_dm, k_dm)):
            cache = PagedKV(kc, vc, 1.0, 1.0) if ops_path == "triton" else PagedKV(kc, vc)
            store(k, v, cache, slots)
            seal(cache, slots)
        done = end
        assert torch.equal(logical_values(v_dm, table, [end]).view(torch.uint8), v_tm.view(torch.uint8)), end


@pytest.mark.parametrize("num_splits,block_n", [(1, 64), (1, 32), (3, 32)])
def test_decode_reads_dims_major_v(num_splits: int, block_n: int) -> None:
    """Whole runs of a page's tokens are read, past a sequence's end too (random finite values there, as a
    reused page holds), and each open page token-major: the output is bit for bit the token-major cache's, and
    close to the reference."""
    gen = torch.Generator().manual_seed(num_splits * 10 + block_n)
    lens = [32 * 3 + 5, 17, 1, 0, 64, 130, 31, 32]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 32, gen)
    k8, k_deq = quantize(k_cache, 0.05)
    v8, v_deq = quantize(v_cache, 0.05)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(num_splits=num_splits, block_n=block_n, f16_dot=True)
    token_major = paged_decode_attention_triton(q, PagedKV(k8, v8, 0.05, 0.05), tables, seq_lens, SCALE,
                                                run_addressing=True, **kw)
    dims_major = paged_decode_attention_triton(q, PagedKV(k8, engine_layout(v8, tables, lens), 0.05, 0.05), tables,
                                               seq_lens, SCALE, **kw)
    # the open page is a tile of its own, taken first: the online softmax rescales at other points
    full_pages = [i for i, n in enumerate(lens) if n % 32 == 0]  # no open page: the same tiles, bit for bit
    assert torch.equal(dims_major[full_pages], token_major[full_pages])
    torch.testing.assert_close(dims_major, token_major, atol=1e-4, rtol=1e-3)
    ref = paged_attention_ref(q, PagedKV(k_deq, v_deq), torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens,
                              tables, SCALE)
    ref[seq_lens == 0] = 0.0
    torch.testing.assert_close(dims_major, ref, atol=2e-3, rtol=2e-3)


def test_decode_with_fused_rope_stores_into_dims_major_v() -> None:
    """The decode kernel's own rotary store writes the new token's V into its open page and reads it back; a
    token that fills its page (lengths 32 and 64) seals it. Output and cache as with a token-major cache."""
    from nvcli.kernels.decode_attention import DecodeRope
    from nvcli.models.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(41)
    lens = [70, 33, 1, 0, 64, 32]
    k_cache, v_cache, tables = make_paged_kv(lens, 2, 32, gen)
    k8, _ = quantize(k_cache, 0.01)
    v8, _ = quantize(v_cache, 0.02)
    heads, kv_heads = 4, 2
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * HEAD_DIM, generator=gen)
    positions = torch.tensor([max(n - 1, 0) for n in lens])
    slots = torch.tensor([int(tables[i, (n - 1) // 32]) * 32 + (n - 1) % 32 if n else -1 for i, n in enumerate(lens)])
    rope = RotaryEmbedding(HEAD_DIM, 128, 10000.0, None)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    outs, v_caches = [], []
    before = [max(n - 1, 0) for n in lens]  # the cache holds each sequence's earlier tokens
    for v in (v8, engine_layout(v8, tables, before)):
        t = qkv.clone().to(DEVICE)
        q = t[:, : heads * HEAD_DIM].view(-1, heads, HEAD_DIM)
        k_new = t[:, heads * HEAD_DIM : (heads + kv_heads) * HEAD_DIM].view(-1, kv_heads, HEAD_DIM)
        v_new = t[:, (heads + kv_heads) * HEAD_DIM :].view(-1, kv_heads, HEAD_DIM)
        kc, vc = k8.clone().to(DEVICE), v.clone().to(DEVICE)  # .to keeps the dims-major strides
        assert is_dims_major(vc) == (v is not v8)
        r = DecodeRope(k_new, v_new, positions.to(DEVICE), rope.cos_sin_cache.to(DEVICE), slots.to(DEVICE))
        outs.append(decode_attention.paged_decode_attention_triton(q, PagedKV(kc, vc, 0.01, 0.02), tables.to(DEVICE),
                                                                   seq_lens.to(DEVICE), SCALE, num_splits=2,
                                                                   block_n=32, rope=r).cpu())
        v_caches.append(vc.cpu())
    logical = logical_values(v_caches[1], tables, lens)
    for row, n in enumerate(lens):  # every sequence's tokens (a newly opened page holds anything past its end)
        pos = torch.arange(n)
        blocks, offsets = tables[row, pos // 32].long(), pos % 32
        assert torch.equal(logical[blocks, offsets].view(torch.uint8), v_caches[0][blocks, offsets].view(torch.uint8))
    assert not torch.equal(v_caches[0].view(torch.uint8), v8.view(torch.uint8))  # the new values did land
    assert torch.equal(outs[1], outs[0])


def test_prefill_reads_dims_major_v() -> None:
    """Full prompts, a prefix hit, chunks and decode rows: masked (diagonal) and unmasked tiles, runs past the
    limit holding random finite values, open pages token-major."""
    gen = torch.Generator().manual_seed(43)
    seq_lens_l = [70, 45, 17, 33, 5, 64]
    q_lens = [70, 13, 1, 33, 2, 40]
    k_cache, v_cache, tables = make_paged_kv(seq_lens_l, 2, 32, gen)
    k8, k_deq = quantize(k_cache, 0.02)
    v8, v_deq = quantize(v_cache, 0.01)
    q, qsl = _packed(q_lens, 4, gen)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32)
    args = (qsl, seq_lens, tables, max(q_lens), max(seq_lens_l), SCALE)
    token_major = paged_prefill_attention_triton(q, PagedKV(k8, v8, 0.02, 0.01), *args)
    dims_major = paged_prefill_attention_triton(q, PagedKV(k8, engine_layout(v8, tables, seq_lens_l), 0.02, 0.01),
                                                *args)
    assert torch.equal(dims_major, token_major)
    torch.testing.assert_close(dims_major, paged_attention_ref(q, PagedKV(k_deq, v_deq), qsl, seq_lens, tables, SCALE),
                               atol=2e-4, rtol=1e-3)


def test_dims_major_v_is_fp8_only() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = make_paged_kv([40], 2, 32, gen)
    q = torch.randn(1, 4, HEAD_DIM, generator=gen)
    with pytest.raises(AssertionError, match="fp8-only"):
        decode_attention.paged_decode_attention_triton(q, PagedKV(k_cache, dims_major_copy(v_cache)), tables,
                                                       torch.tensor([40], dtype=torch.int32), SCALE)
