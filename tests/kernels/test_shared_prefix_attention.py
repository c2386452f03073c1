"""Decode attention over pages every sequence shares (kernels/shared_prefix_attention.py) against the reference."""

from __future__ import annotations

import pytest
import torch
from kernel_device import on_device

from nvcli.kernels import shared_prefix_attention
from nvcli.kernels.kv_layout import PagedKV, is_dims_major
from nvcli.kernels.reference import paged_decode_attention_ref

HEAD_DIM = 32
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def shared_case(own: list[int], shared_pages: int, num_kv_heads: int, page: int, gen: torch.Generator,
                dtype: torch.dtype = torch.float32, width_extra: int = 1):
    """Caches and tables where every row's first `shared_pages` pages are the same blocks, then pages of its own;
    a row of own length 0 is a graph's padding row (length 0)."""
    own_pages = [-(-(n) // page) for n in own]
    num_blocks = shared_pages + sum(own_pages) + 2
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = shared_pages + max(own_pages) + width_extra
    tables = torch.full((len(own), width), int(perm[-1]), dtype=torch.int32)
    i = shared_pages
    for s, n in enumerate(own_pages):
        tables[s, :shared_pages] = perm[:shared_pages]
        tables[s, shared_pages:shared_pages + n] = perm[i:i + n]
        i += n
    lens = torch.tensor([shared_pages * page + n if n else 0 for n in own], dtype=torch.int32)
    shape = (num_blocks, page, num_kv_heads, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k, v, tables, lens


def reference(q, k, v, tables, lens) -> torch.Tensor:
    out = paged_decode_attention_ref(q.float(), PagedKV(k.float(), v.float()), tables, lens, HEAD_DIM**-0.5)
    out[lens == 0] = 0.0
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1), (32, 2)])
@pytest.mark.parametrize("page", [16, 32])
def test_matches_reference_across_groupings(num_heads: int, num_kv_heads: int, page: int) -> None:
    gen = torch.Generator().manual_seed(num_heads * 100 + page)
    # 11 rows: not a multiple of any program's sequence count; own parts from one token to past a page
    own = [1, page, page + 3, 5, 2 * page - 1, 7, 1, 40, 3, page + 1, 9]
    k, v, tables, lens = shared_case(own, 3, num_kv_heads, page, gen)
    q = torch.randn(len(own), num_heads, HEAD_DIM, generator=gen)
    order = torch.argsort(lens, descending=True).to(torch.int32)
    run = on_device(shared_prefix_attention.shared_prefix_decode_attention_triton)
    out = run(q, PagedKV(k, v), tables, lens, torch.tensor([3 * page], dtype=torch.int32), HEAD_DIM**-0.5, order)
    torch.testing.assert_close(out, reference(q, k, v, tables, lens), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("num_seqs", [5, 40])
def test_a_long_shared_prefix_split_across_programs(num_seqs: int) -> None:
    """The shared pages are split between programs (the fewer the groups, the more splits: 8 here), several tiles
    each, whose partial results the last program of a group to finish merges with its sequences' own parts (one
    group, and five). The result is the reference's, and the arrival counters are left at zero for the next call (a
    CUDA graph replays them)."""
    from nvcli.kernels import arrival_counters

    gen = torch.Generator().manual_seed(num_seqs)
    own = [1 + (7 * i) % 40 for i in range(num_seqs)]
    k, v, tables, lens = shared_case(own, 45, 2, 16, gen)  # 720 shared tokens: several 64-token tiles per split
    q = torch.randn(num_seqs, 4, HEAD_DIM, generator=gen)
    order = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
    run = on_device(shared_prefix_attention.shared_prefix_decode_attention_triton)
    for _ in range(2):
        out = run(q, PagedKV(k, v), tables, lens, torch.tensor([45 * 16], dtype=torch.int32), HEAD_DIM**-0.5, order)
        torch.testing.assert_close(out, reference(q, k, v, tables, lens), atol=2e-4, rtol=1e-3)
        assert arrival_counters.all_zero()


def test_each_group_of_rows_reads_its_own_shared_pages() -> None:
    """Per-group shared lengths (a step whose rows carry two instructions, ordered so that each group of 8 holds one
    instruction's rows): group 0 shares 3 pages, group 1 five others, group 2 (a partial group) nothing."""
    gen = torch.Generator().manual_seed(11)
    cases = [shared_case([5, 17, 1, 30, 9, 12, 16, 2], 3, 2, 16, gen),
             shared_case([7, 1, 33, 4, 20, 8, 3, 11], 5, 2, 16, gen), shared_case([40, 6, 19], 0, 2, 16, gen)]
    width = max(c[2].shape[1] for c in cases)
    k, v, tables, lens, base = [], [], [], [], 0
    for ck, cv, ct, cl in cases:
        k.append(ck)
        v.append(cv)
        tables.append(torch.nn.functional.pad(ct + base, (0, width - ct.shape[1]), value=base))
        lens.append(cl)
        base += ck.shape[0]
    k, v, tables, lens = torch.cat(k), torch.cat(v), torch.cat(tables), torch.cat(lens)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    run = on_device(shared_prefix_attention.shared_prefix_decode_attention_triton)
    shared = torch.tensor([48, 80, 0], dtype=torch.int32)
    out = run(q, PagedKV(k, v), tables, lens, shared, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, reference(q, k, v, tables, lens), atol=2e-4, rtol=1e-3)
    wrong = run(q, PagedKV(k, v), tables, lens, torch.tensor([80, 48, 0], dtype=torch.int32), HEAD_DIM**-0.5)
    assert not torch.allclose(wrong[:8], out[:8], atol=1e-3)  # group 0 told of 5 shared pages reads row 0's own


def test_no_shared_pages_is_plain_decode_and_padding_rows_are_zero() -> None:
    gen = torch.Generator().manual_seed(7)
    own = [20, 0, 5, 33, 0]  # two padding rows (length 0), as a CUDA graph pads a step
    k, v, tables, lens = shared_case(own, 0, 2, 16, gen)
    q = torch.randn(len(own), 4, HEAD_DIM, generator=gen)
    run = on_device(shared_prefix_attention.shared_prefix_decode_attention_triton)
    out = run(q, PagedKV(k, v), tables, lens, torch.tensor([0], dtype=torch.int32), HEAD_DIM**-0.5)
    torch.testing.assert_close(out, reference(q, k, v, tables, lens), atol=2e-4, rtol=1e-3)
    assert (out[lens == 0] == 0).all()


def test_half_precision() -> None:
    gen = torch.Generator().manual_seed(3)
    own = [4, 17, 30, 1, 16, 2, 9, 12, 25]
    k, v, tables, lens = shared_case(own, 4, 2, 16, gen, dtype=torch.float16)
    q = torch.randn(len(own), 4, HEAD_DIM, generator=gen).to(torch.float16)
    run = on_device(shared_prefix_attention.shared_prefix_decode_attention_triton)
    out = run(q, PagedKV(k, v), tables, lens, torch.tensor([64], dtype=torch.int32), HEAD_DIM**-0.5)
    torch.testing.assert_close(out.float(), reference(q, k, v, tables, lens), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page", [32, 16])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_fp8_cache(page: int, q_dtype: torch.dtype) -> None:
    """An fp8 cache with per-tensor scales (device scalars, as the engine's layers hold them). With 32-token pages V
    is kept as the engine keeps it: full pages dims-major, each sequence's open page token-major (kv_layout.py);
    with 16-token pages token-major. The kernel reads the shared pages once and the own pages of each sequence, full
    and open, and equals the reference over the dequantized cache."""
    from test_attention_kernels import quantize
    from test_kv_layout import engine_layout

    gen = torch.Generator().manual_seed(page + (q_dtype == torch.float32))
    own = [page, 2 * page, 5, page + 3, 1, 0, 3 * page - 1, 9, page - 1]  # whole pages, open pages, padding
    k, v, tables, lens = shared_case(own, 9, 2, page, gen)  # 9 pages: split 5 ways, the last share one page
    k8, k_deq = quantize(k, 0.05)
    v8, v_deq = quantize(v, 0.07)
    if page == 32:
        v8 = engine_layout(v8, tables, lens.tolist())
        assert is_dims_major(v8)
    q = torch.randn(len(own), 4, HEAD_DIM, generator=gen).to(q_dtype)
    order = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
    run = on_device(shared_prefix_attention.shared_prefix_decode_attention_triton)
    out = run(q, PagedKV(k8, v8, k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.07])), tables, lens,
              torch.tensor([9 * page], dtype=torch.int32), HEAD_DIM**-0.5, order)
    tol = 1e-4 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference(q, k_deq, v_deq, tables, lens), atol=tol, rtol=tol)


def test_a_wrong_shared_length_changes_the_answer() -> None:
    """The kernel trusts the caller: told that pages are shared which are not, rows read the first row's pages."""
    gen = torch.Generator().manual_seed(5)
    k, v, tables, lens = shared_case([6, 6, 6], 0, 1, 16, gen)
    q = torch.randn(3, 2, HEAD_DIM, generator=gen)
    run = on_device(shared_prefix_attention.shared_prefix_decode_attention_triton)
    out = run(q, PagedKV(k, v), tables, lens, torch.tensor([0], dtype=torch.int32), HEAD_DIM**-0.5)
    torch.testing.assert_close(out, reference(q, k, v, tables, lens), atol=2e-4, rtol=1e-3)
    lens16 = lens + 16
    tables16 = torch.cat([tables[:, :1], tables], dim=1)  # one more page in front, different per row
    tables16[:, 0] = torch.tensor([tables[0, 0], tables[1, 0], tables[2, 0]])
    wrong = run(q, PagedKV(k, v), tables16, lens16, torch.tensor([16], dtype=torch.int32), HEAD_DIM**-0.5)
    assert not torch.allclose(wrong, reference(q, k, v, tables16, lens16), atol=1e-3)



@pytest.mark.parametrize("fp8", [False, True])
def test_one_token_rows_beside_prompt_chunks_read_the_shared_pages_once(monkeypatch: pytest.MonkeyPatch,
                                                                        fp8: bool) -> None:
    """A mixed step of a job behind one instruction (its steady state: new lines join while others decode): the
    one-token rows go to the shared-prefix kernel (DecodeSplit.shared_prefix_len), written into the leading rows of
    the step's output, and the prompt chunks (new lines, their instruction cached) to the prefill kernel. As a CUDA
    graph holds it, the decode capacity reaches into the prompt rows and the step ends in padding rows. Every real row
    equals the reference over the whole step. fp8: 32-token pages, V as the engine keeps it (dims-major but the open
    pages), the per-tensor scales passed through."""
    from kernel_device import DEVICE

    from nvcli.attention.forward import split_attention as paged_split_attention
    from nvcli.attention.metadata import DecodeSplit
    from nvcli.kernels.reference import paged_attention_ref

    gen = torch.Generator().manual_seed(29)
    page, shared_pages, num_heads, num_kv_heads = 32 if fp8 else 16, 3, 4, 2
    own = [5, 17, 1, 30, 9, 12, 16, 2, 40, 20, 7]  # decode rows, then two prompt chunks' sequences
    q_lens = [1] * 9 + [20, 7]  # the chunks: a whole line after the instruction, and one's last 7 tokens
    k, v, tables, lens = shared_case(own, shared_pages, num_kv_heads, page, gen)
    scales = {}
    if fp8:
        from test_attention_kernels import quantize
        from test_kv_layout import engine_layout

        (k, k_deq), (v, v_deq) = quantize(k, 0.05), quantize(v, 0.07)
        v = engine_layout(v, tables, lens.tolist())
        scales = dict(k_scale=torch.tensor([0.05], device=DEVICE), v_scale=torch.tensor([0.07], device=DEVICE))
    d, num_tokens = q_lens.count(1), sum(q_lens)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    want = paged_attention_ref(q, PagedKV(k_deq, v_deq) if fp8 else PagedKV(k, v), qsl, lens, tables, HEAD_DIM**-0.5)
    d_cap, pad = d + 4, 3  # a graph's decode capacity past the real rows, and its padding token rows
    dec_lens = torch.zeros(d_cap, dtype=torch.int32)
    dec_lens[:d] = lens[:d]
    dec_tables = torch.zeros(d_cap, tables.shape[1], dtype=torch.int32)
    dec_tables[:d] = tables[:d]
    order = torch.argsort(-dec_lens, stable=True).to(torch.int32)
    pre_qsl = torch.cat([qsl[d:], torch.tensor([num_tokens], dtype=torch.int32)])
    pre_lens = torch.cat([lens[d:], torch.zeros(1, dtype=torch.int32)])
    pre_tables = torch.cat([tables[d:], torch.zeros(1, tables.shape[1], dtype=torch.int32)])
    q_in = torch.cat([q, torch.randn(pad, num_heads, HEAD_DIM, generator=gen)])
    calls = []
    kernel = shared_prefix_attention.shared_prefix_decode_attention_triton
    monkeypatch.setattr(shared_prefix_attention, "shared_prefix_decode_attention_triton",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))

    def run(shared: int | None) -> torch.Tensor:
        dev = lambda t: t.to(DEVICE)  # noqa: E731
        split = DecodeSplit(d_cap, dev(dec_lens), dev(dec_tables), dev(order), dev(pre_qsl), dev(pre_lens),
                            dev(pre_tables), max(q_lens[d:]),
                            shared_prefix_len=None if shared is None else dev(torch.tensor([shared], dtype=torch.int32)))
        return paged_split_attention(dev(q_in), PagedKV(dev(k), dev(v), **scales), split, HEAD_DIM**-0.5).cpu()[
            :num_tokens]

    torch.testing.assert_close(run(shared_pages * page), want, atol=2e-4, rtol=1e-3)
    assert calls == [d_cap]  # the one-token rows (the graph's capacity of them) went to the shared-prefix kernel
    torch.testing.assert_close(run(None), want, atol=2e-4, rtol=1e-3)
    assert calls == [d_cap]
