"""Attention's kernel calls: per-head norm, rotary, KV store, page sealing and paged attention for one layer.

The layer hands over raw q / k / v projections and the step's AttentionMetadata; what runs follows from the
metadata alone (the backend's plan, attention/backend.py):
- CPU (and any non-CUDA tensor): the torch references, one op at a time.
- a decode step (one token per sequence) on the GPU: norm + rotary + KV store inside the decode attention kernel
  (one launch per layer fewer), unless its rows read a shared prefix or the step is batch-invariant;
- every other GPU step: one fused kernel for norm + rotary + KV store, then the decode kernel for the one-token rows
  of a split step (meta.split), the shared-prefix kernel where the plan found shared pages, the prefill kernel for
  prompt chunks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nvcli.attention.metadata import AttentionMetadata, DecodeSplit
from nvcli.kernels import ops
from nvcli.kernels.kv_layout import PagedKV


class PagedLayer(Protocol):
    """What attention reads of a layer: its cache (kv_layout.py; its fp8 scales are read in place) and softmax scale."""

    kv: PagedKV | None  # None until the model runner binds the cache
    scale: float  # softmax scale


class Rotary(Protocol):
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


class HeadNorm(Protocol):
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def paged_attention(
    layer: PagedLayer,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], raw projections (normed and rotated here)
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    positions: torch.Tensor,  # [num_tokens] int64
    meta: AttentionMetadata,
    rotary: Rotary,
    q_norm: HeadNorm | None = None,  # per-head RMSNorm (Qwen3), both or neither
    k_norm: HeadNorm | None = None,
    scale_rows: torch.Tensor | None = None,  # deferred norm on the GPU (models/llama.py): q, k, v scaled by 1 / RMS
    scale_eps: float = 1e-6,
    qkv_ratios: torch.Tensor | None = None,  # [3] float32 with scale_rows (GPU): q's, k's and v's own factors beside it
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    kv = layer.kv
    assert kv is not None, "the model runner binds each layer's KV cache before its first forward"
    if not ops.use_triton(q):
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rotary(positions, q, k)
        ops.store_kvcache(k, v, kv, meta.slot_mapping)
        ops.seal_pages(kv, meta.slot_mapping)
        if meta.split is not None:  # planned for the GPU; on CPU tensors the kernels run in Triton's interpreter
            return split_attention(q, kv, meta.split, layer.scale, meta.invariant)
        if meta.decode_only:
            return ops.paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, layer.scale)
        return ops.paged_prefill_attention(q, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                           meta.max_query_len, meta.max_seq_len, layer.scale)
    q_w = q_norm.weight if q_norm is not None else None
    k_w = k_norm.weight if k_norm is not None else None
    eps = q_norm.eps if q_norm is not None else 0.0
    if meta.decode_only and meta.shared_prefix_len is None and not meta.invariant:
        from nvcli.kernels.decode_attention import DecodeRope, paged_decode_attention_triton

        rope = DecodeRope(k, v, positions, rotary.cos_sin_cache, meta.slot_mapping, q_w, k_w, eps, scale_rows,
                          scale_eps, qkv_ratios)
        return paged_decode_attention_triton(q, kv, meta.block_tables, meta.seq_lens, layer.scale, rope=rope,
                                             order=meta.decode_order)
    from nvcli.kernels.rotary import rope_qk_norm_triton

    q, k = rope_qk_norm_triton(q, k, positions, rotary.cos_sin_cache, q_w, k_w, eps, v=v, kv=kv,
                               slot_mapping=meta.slot_mapping, scale_rows=scale_rows, scale_eps=scale_eps,
                               qkv_ratios=qkv_ratios)
    # A page is full once its last slot is written, so this step's slots name the pages it filled (kv_layout.py)
    ops.seal_pages(kv, meta.slot_mapping)
    if meta.split is not None:
        return split_attention(q, kv, meta.split, layer.scale, meta.invariant)
    if meta.decode_only and not meta.invariant:  # rows that read a shared prefix (the decode graphs' plan)
        from nvcli.kernels.shared_prefix_attention import shared_prefix_decode_attention_triton

        return shared_prefix_decode_attention_triton(q, kv, meta.block_tables, meta.seq_lens, meta.shared_prefix_len,
                                                     layer.scale, meta.decode_order)
    from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

    return paged_prefill_attention_triton(q, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                          meta.max_query_len, meta.max_seq_len, layer.scale, invariant=meta.invariant)


def split_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: PagedKV,
    split: DecodeSplit,
    scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """Attention of a step whose first `split.num_rows` rows are one-token queries (decode kernel) and whose other
    rows are prompt chunks (prefill kernel) -> like q. GPU only (the plan splits GPU steps only).

    The decode kernel runs first: in a CUDA graph its capacity may reach into the prompt rows, where it writes
    zeros (length 0) that the prefill kernel then overwrites. `invariant` (--batch-invariant): the one-token rows
    take the prefill kernel's invariant form too, one query each, so every row gets the same arithmetic."""
    from nvcli.kernels.decode_attention import paged_decode_attention_triton
    from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    d = split.num_rows
    if d and invariant:
        one_each = torch.arange(d + 1, dtype=torch.int32, device=q.device)  # [d + 1] query starts
        paged_prefill_attention_triton(q[:d], kv, one_each, split.seq_lens, split.block_tables, 1, 0, scale,
                                       out=out[:d], invariant=True)
    elif d and split.shared_prefix_len is not None:
        from nvcli.kernels.shared_prefix_attention import shared_prefix_decode_attention_triton

        shared_prefix_decode_attention_triton(q[:d], kv, split.block_tables, split.seq_lens, split.shared_prefix_len,
                                              scale, split.order, out=out[:d])
    elif d:
        paged_decode_attention_triton(q[:d], kv, split.block_tables, split.seq_lens, scale, order=split.order,
                                      out=out[:d])
    if split.prefill_seq_lens.shape[0]:
        paged_prefill_attention_triton(q, kv, split.prefill_query_start_loc, split.prefill_seq_lens,
                                       split.prefill_block_tables, split.prefill_max_query_len, 0, scale, out=out,
                                       invariant=invariant)
    return out
