"""Triton kernels writing a step's keys/values into the paged KV cache, and sealing the pages a step filled.

Layouts (see `reference.py`): key/value `[num_tokens, num_kv_heads, head_dim]`, a layer's cache one `PagedKV`
of `[num_blocks, block_size, num_kv_heads, head_dim]` views (V may be dims-major, see `kv_layout.py`: stores
write V token-major through its open-page view, and `seal_pages_triton` turns the filled pages dims-major),
slot = block_id * block_size + offset, slot -1 = padding (skipped). An fp8
(`torch.float8_e4m3fn`) cache stores `clamp(x / scale, -448, 448)` cast to fp8 with a per-tensor
scale (python float or a 1-element tensor, default 1.0), and NaN as 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvcli.kernels.kv_layout import PagedKV, Scale

FP8_E4M3_MAX = 448.0


def scale_args(
    k_scale: Scale, v_scale: Scale, dummy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float, float, bool]:
    """Kernel arguments (k_ptr, v_ptr, k_val, v_val, is_ptr) for a pair of per-tensor scales.

    Scales may be None (= 1.0), python floats or 1-element tensors. Tensor scales are read by
    the kernel from device memory (no host sync, CUDA-graph safe); floats are passed by value
    and `dummy` stands in for the unused pointers. If only one is a tensor the other is
    materialised on the device with `torch.full` (a fill kernel, also capture safe).
    """
    k_t = isinstance(k_scale, torch.Tensor)
    v_t = isinstance(v_scale, torch.Tensor)
    if not (k_t or v_t):
        k_val = 1.0 if k_scale is None else float(k_scale)
        v_val = 1.0 if v_scale is None else float(v_scale)
        return dummy, dummy, k_val, v_val, False

    def as_tensor(s: Scale) -> torch.Tensor:
        if isinstance(s, torch.Tensor):
            assert s.numel() == 1, "per-tensor scale must have one element"
            return s.reshape(1).to(device=dummy.device, dtype=torch.float32)
        return torch.full((1,), 1.0 if s is None else float(s), dtype=torch.float32, device=dummy.device)

    return as_tensor(k_scale), as_tensor(v_scale), 1.0, 1.0, True


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def load_scales(k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, SCALE_IS_PTR: tl.constexpr):
    """The (k, v) per-tensor scales inside a kernel: from device memory or by value (see scale_args)."""
    ks = k_scale_val
    vs = v_scale_val
    if SCALE_IS_PTR:
        ks = tl.load(k_scale_ptr)
        vs = tl.load(v_scale_ptr)
    return ks, vs


@triton.jit
def store_to_cache(ptrs, x, scale, mask, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """Write x into cache slots: an fp8 cache gets x / scale saturated to +-FP8_MAX (div_rn: IEEE
    division, so it rounds like torch; plain / is div.full.f32, ~2 ulp) and NaN as 0 (no slot of an fp8
    cache may hold a NaN: see kv_layout.py), others x in their dtype."""
    if QUANT:
        x = tl.div_rn(x.to(tl.float32), scale)
        x = tl.clamp(tl.where(x == x, x, 0.0), -FP8_MAX, FP8_MAX)
    if mask is None:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty))
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_val,
    v_scale_val,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    offs_d = tl.arange(0, DIM_PAD)[None, :]  # [1, DIM_PAD]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)

    tok64 = tok.to(tl.int64)
    k = tl.load(key_ptr + tok64 * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + offs_h * stride_kch + offs_d
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h * stride_vch + offs_d * stride_vcd
    ks, vs = load_scales(k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, SCALE_IS_PTR)
    store_to_cache(kc, k, ks, mask, QUANT, FP8_MAX)
    store_to_cache(vc, v, vs, mask, QUANT, FP8_MAX)


def store_kvcache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv: PagedKV,
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
) -> None:
    """Scatter key/value rows into the paged caches (V through its open-page view); fp8 caches store x / scale
    (saturated)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape
    assert (kv.num_kv_heads, kv.head_dim) == (num_kv_heads, head_dim)
    assert slot_mapping.shape[0] == num_tokens
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    quant = kv.fp8
    # scales only apply to an fp8 cache
    k_ptr, v_ptr, k_val, v_val, scale_is_ptr = scale_args(kv.k_scale if quant else None,
                                                          kv.v_scale if quant else None, slot_mapping)
    elements = num_kv_heads * head_dim
    num_warps = 1 if elements <= 256 else (2 if elements <= 1024 else 4)
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        kv.k,
        kv.v_open,
        slot_mapping,
        k_ptr,
        v_ptr,
        k_val,
        v_val,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *kv.store_strides,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv.block_size,
        QUANT=quant,
        SCALE_IS_PTR=scale_is_ptr,
        FP8_MAX=FP8_E4M3_MAX if kv.dtype == torch.float8_e4m3fn else 57344.0,
        num_warps=num_warps,
    )


@triton.jit
def seal_page(head_page, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Transpose one head's region of a page in place, from the open (token-major) layout to dims-major. The
    calling program must be the only one touching the region; the barrier keeps every thread's loads ahead of
    any store."""
    offs_t = tl.arange(0, PAGE)
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(head_page + offs_t[:, None] * HEAD_DIM + offs_d[None, :])  # [PAGE, HEAD_DIM]
    tl.debug_barrier()
    tl.store(head_page + offs_d[None, :] * PAGE + offs_t[:, None], x)


@triton.jit
def _seal_pages_kernel(v_cache_ptr, slot_ptr, num_slots, stride_vb, stride_vh, PAGE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, SLOTS: tl.constexpr):
    # SLOTS slots of one KV head per program: a prompt step has ~16k slots and seals only one in PAGE of them, so a
    # program per (slot, head) would be mostly launches that exit; a program for every head of its slots sealed them
    # one after another (8 x 2 us for a decode step's few seals: 18 us per layer)
    first = tl.program_id(0) * SLOTS
    h = tl.program_id(1)
    for i in range(first, tl.minimum(first + SLOTS, num_slots)):
        slot = tl.load(slot_ptr + i).to(tl.int64)
        if (slot >= 0) & (slot % PAGE == PAGE - 1):
            seal_page(v_cache_ptr + (slot // PAGE) * stride_vb + h * stride_vh, PAGE, HEAD_DIM)


def seal_pages_triton(kv: PagedKV, seal_slots: torch.Tensor) -> None:
    """Turn dims-major the pages whose last slot is in `seal_slots` ([n] int; other slots and -1 are skipped, so
    a decode step passes its slot mapping: CUDA-graph safe). No-op unless V is dims-major (kv_layout.py)."""
    if not kv.v_dims_major or seal_slots.numel() == 0:
        return
    page, head_dim = kv.block_size, kv.head_dim
    slots_per_program = 32
    _seal_pages_kernel[(triton.cdiv(seal_slots.shape[0], slots_per_program), kv.num_kv_heads)](
        kv.v, seal_slots, seal_slots.shape[0], kv.strides[3], kv.strides[5], PAGE=page,  # V's block and head strides
        HEAD_DIM=head_dim, SLOTS=slots_per_program, num_warps=4 if page * head_dim >= 4096 else 2,
    )
