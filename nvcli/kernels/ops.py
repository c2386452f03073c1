"""Kernel entry points used by the model: Triton on CUDA tensors, the torch reference elsewhere.

Setting NV_ATTENTION_BACKEND=torch forces the references on the GPU too (for A/B checks).
"""

from __future__ import annotations

import os

import torch

from nvcli.kernels import reference


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("NV_ATTENTION_BACKEND", "triton") == "triton"


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    if _use_triton(key):
        from nvcli.kernels.kv_store import store_kvcache_triton

        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
) -> torch.Tensor:
    if _use_triton(q):
        from nvcli.kernels.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return reference.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    if _use_triton(q):
        from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len, scale
        )
    return reference.paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
