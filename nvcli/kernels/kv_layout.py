"""Page layouts of the paged KV cache.

Every kernel and the torch reference see a layer's K and V cache as `[num_blocks, block_size,
num_kv_heads, head_dim]` tensors and address them through all four strides. K pages are stored
token-major (that shape, contiguous). V pages are too, except in an fp8 cache with 32-token pages:
there each page is stored dims-major, `[num_kv_heads, head_dim, block_size]` (a head's 32 tokens of one
dim are one 32-byte DRAM sector), and the cache is the permuted view of that storage. Code that
scatters or gathers slots (the KV store, the rotary store, the reference) is layout-blind through the
strides (stores go through `open_page_view`, see open pages below); the attention kernels read a dims-major page
as V transposed, `[head_dim, tokens]` (`is_dims_major`).

Why: the decode kernel's PV product needs V with tokens along its reduction axis. From a token-major
fp8 page Triton gets that through shared memory twice (copy in, convert, write back as fp16, read with
`ldmatrix.trans`), and the fp8 kernel is bound by that shared-memory traffic (Nsight: L1/shared 78%,
DRAM 74%). Dims-major V is read like K. Measured on an H100: with
32-token pages it is 3-8% faster than token-major V with 16-token pages at the workload's shapes,
bitwise the same output; with 16- or 64-token pages it was slower, so other page sizes stay
token-major.

Open pages. A dims-major page is written whole, never one token at a time: a new token's V in a dims-major page is
128 one-byte stores into 128 sectors per (token, head), which cost the fp8 decode kernel 7-10 us per layer at 256
sequences (benchmarks/RESULTS.md: 262k sector writes per call). So only *full* pages are dims-major. A sequence's last
page while it is partial (its open page, tokens [seq_len // block_size * block_size, seq_len)) keeps its V
token-major inside the same bytes: each head's `head_dim * block_size` region holds `[block_size, head_dim]` rows
instead of `[head_dim, block_size]` columns (`open_page_view`). Every store writes token-major (a token's V is one
128-byte row); the page that a step fills is then sealed, transposed in place to dims-major (`seal_pages`): by the
decode kernel's program that wrote its last token, or after the store by a kernel over the step's slots.
Readers take positions below `seq_len // block_size * block_size` dims-major and the open page token-major. Blocks
are shared by prefix caching only once full, and the block of a sequence's last token is never a cache hit, so a
sealed page is never written again.

A dims-major V cache loads whole runs of a page's tokens, past a sequence's end too, where the softmax
weight is exactly 0. That is only exact while every slot holds a finite number: fp8 stores saturate
and store NaN as 0, so an fp8 cache never holds anything else (dims-major is fp8-only for that reason).
"""

from __future__ import annotations

import torch

DIMS_MAJOR_ROW_BYTES = 32  # one DRAM sector per (head, dim) row of a page


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def v_dims_major(dtype: torch.dtype, block_size: int) -> bool:
    """Whether a V cache of this dtype and page size is stored dims-major (its full pages; see open pages)."""
    return _is_fp8(dtype) and block_size * torch.empty(0, dtype=dtype).element_size() == DIMS_MAJOR_ROW_BYTES


def page_view(
    flat: torch.Tensor,  # [num_blocks, block_size * num_kv_heads * head_dim]: one layer's storage
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dims_major: bool,
) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim] (a view of `flat`)
    num_blocks = flat.shape[0]
    if dims_major:
        return flat.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)
    return flat.view(num_blocks, block_size, num_kv_heads, head_dim)


def is_dims_major(cache: torch.Tensor) -> bool:
    """Whether a `[num_blocks, block_size, num_kv_heads, head_dim]` cache view is stored dims-major
    (`page_view(..., dims_major=True)`). Pages of contiguous (token, head) rows in any order are not (the
    kernels take their strides); any other layout is refused, and so is a dims-major cache that is not fp8."""
    nb, bs, h, d = cache.shape
    if cache.stride(-1) == 1:
        return False
    assert cache.stride(1) == 1 and cache.stride(3) == bs and (h == 1 or cache.stride(2) == d * bs), (
        f"KV cache strides {cache.stride()} are neither token-major nor dims-major pages"
    )
    assert _is_fp8(cache.dtype), "dims-major V pages are fp8-only (kv_layout.py)"
    return True


def open_page_view(v_cache: torch.Tensor) -> torch.Tensor:
    """Where stores write V and where readers find a sequence's open page: for a dims-major V cache, the token-major
    view `[num_blocks, block_size, num_kv_heads, head_dim]` of the same bytes (each head's region as
    `[block_size, head_dim]` rows); any other cache is returned as it is."""
    if not is_dims_major(v_cache):
        return v_cache
    nb, bs, h, d = v_cache.shape
    return v_cache.as_strided((nb, bs, h, d), (v_cache.stride(0), d, d * bs, 1))


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Zeroed storage `[2, num_layers, num_blocks, page elements]` (K, V) and each layer's (k_cache, v_cache)
    views; V is dims-major where `v_dims_major` says so."""
    storage = torch.zeros((2, num_layers, num_blocks, block_size * num_kv_heads * head_dim), dtype=dtype, device=device)
    v_major = v_dims_major(dtype, block_size)
    pairs = [
        (page_view(storage[0, i], block_size, num_kv_heads, head_dim, False),
         page_view(storage[1, i], block_size, num_kv_heads, head_dim, v_major))
        for i in range(num_layers)
    ]
    return storage, pairs
