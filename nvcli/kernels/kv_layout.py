"""Page layouts of the paged KV cache.

Every kernel and the torch reference see a layer's K and V cache as `[num_blocks, block_size,
num_kv_heads, head_dim]` tensors and address them through all four strides. K pages are stored
token-major (that shape, contiguous). V pages are too, except in an fp8 cache with 32-token pages:
there each page is stored dims-major, `[num_kv_heads, head_dim, block_size]` (a head's 32 tokens of one
dim are one 32-byte DRAM sector), and the cache is the permuted view of that storage. Code that
scatters or gathers slots (the KV store, the rotary store, the reference) is layout-blind through the
strides (stores go through `open_page_view`, see open pages below); the attention kernels read a dims-major page
as V transposed, `[head_dim, tokens]` (`is_dims_major`). A layer's cache travels as one `PagedKV`: the two views,
the fp8 scales, and what the kernels derive from them (computed once, at construction).

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

from dataclasses import dataclass, field
from typing import Union

import torch

DIMS_MAJOR_ROW_BYTES = 32  # one DRAM sector per (head, dim) row of a page

# A per-tensor scale of an fp8 cache: None (= 1.0), a python float, or a 1-element float32 tensor read on the device
Scale = Union[float, torch.Tensor, None]


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


@dataclass(frozen=True, eq=False, slots=True)
class PagedKV:
    """One layer's paged KV cache: K and V `[num_blocks, block_size, num_kv_heads, head_dim]` views (K token-major,
    V token- or dims-major) and an fp8 cache's per-tensor scales (`Scale`; caches of other dtypes ignore them).

    Everything the kernels derive from the layout (shape, dtype, whether V is dims-major, the views' strides) is
    computed here once, not per kernel call: the decode step is host-latency bound, and a layer's cache is built at
    start-up and read by every step. Frozen, with identity equality: captured CUDA graphs hold the addresses of the
    tensors they were captured with, so the engine's scales are filled in place and a layer's binding is not replaced
    once graphs are captured."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: Scale = None
    v_scale: Scale = None
    num_blocks: int = field(init=False)
    block_size: int = field(init=False)
    num_kv_heads: int = field(init=False)
    head_dim: int = field(init=False)
    dtype: torch.dtype = field(init=False)
    fp8: bool = field(init=False)
    v_dims_major: bool = field(init=False)  # V's full pages dims-major (see open pages), read as V transposed
    v_open: torch.Tensor = field(init=False)  # open_page_view(v): where stores write V (v itself unless dims-major)
    # (K block, token, head, V block, token, head, dim) strides: the order the kernels take them (the readers' V view)
    strides: tuple[int, int, int, int, int, int, int] = field(init=False)
    # the same with V's open-page view: what the stores (KV store, rotary store) address V through
    store_strides: tuple[int, int, int, int, int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        k, v = self.k, self.v
        assert k.shape == v.shape and k.dim() == 4, f"K {tuple(k.shape)} and V {tuple(v.shape)} pages differ"
        assert k.dtype == v.dtype, f"K is {k.dtype}, V {v.dtype}"
        assert k.stride(-1) == 1, "K pages are token-major (kv_layout.py)"
        dims_major = is_dims_major(v)  # asserts one of the two V layouts (and fp8 for dims-major)
        v_open = open_page_view(v)
        num_blocks, block_size, num_kv_heads, head_dim = k.shape
        k_strides = (k.stride(0), k.stride(1), k.stride(2))
        values = {
            "num_blocks": num_blocks, "block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "dtype": k.dtype, "fp8": _is_fp8(k.dtype), "v_dims_major": dims_major, "v_open": v_open,
            "strides": k_strides + (v.stride(0), v.stride(1), v.stride(2), v.stride(3)),
            "store_strides": k_strides + (v_open.stride(0), v_open.stride(1), v_open.stride(2), v_open.stride(3)),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)  # frozen: set once, here


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    scale: float = 1.0,
) -> tuple[torch.Tensor, list[PagedKV]]:
    """Zeroed storage `[2, num_layers, num_blocks, page elements]` (K, V) and each layer's PagedKV: page views of
    it (V dims-major where `v_dims_major` says so) and the layer's own `[1]` float32 K and V scales on `device`,
    set to `scale` (read in place by the kernels and by captured CUDA graphs; fill them in place, never rebind)."""
    storage = torch.zeros((2, num_layers, num_blocks, block_size * num_kv_heads * head_dim), dtype=dtype, device=device)
    v_major = v_dims_major(dtype, block_size)
    return storage, [
        PagedKV(page_view(storage[0, i], block_size, num_kv_heads, head_dim, False),
                page_view(storage[1, i], block_size, num_kv_heads, head_dim, v_major),
                torch.full((1,), scale, dtype=torch.float32, device=device),
                torch.full((1,), scale, dtype=torch.float32, device=device))
        for i in range(num_layers)
    ]
