"""Kernel entry points used by the model: Triton on CUDA tensors, the torch reference elsewhere.

The model layers, attention (nvcli/attention/) and the sampler ask `use_triton` too: one rule for every kernel.

k_scale / v_scale are the per-tensor scales of an fp8 KV cache (None = 1.0, a float or a
1-element float32 tensor; tensors are read on the device, so CUDA graphs may capture them):
the store writes clamp(x / scale, +-fp8 max) and attention reads cache * scale. Caches of any
other dtype ignore them.
"""

from __future__ import annotations

import torch

from nvcli.kernels import reference
from nvcli.kernels.reference import Scale


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s computation goes to a Triton kernel: on CUDA; elsewhere the torch reference runs."""
    return t.is_cuda


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    if use_triton(key):
        from nvcli.kernels.kv_store import store_kvcache_triton

        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    else:
        reference.store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def seal_pages(v_cache: torch.Tensor, seal_slots: torch.Tensor) -> None:
    """After a step's store: turn dims-major the pages it filled, those whose last slot is in `seal_slots`
    (kv_layout.py, open pages); a no-op for caches that are not dims-major."""
    if use_triton(seal_slots):
        from nvcli.kernels.kv_store import seal_pages_triton

        seal_pages_triton(v_cache, seal_slots)
    else:
        reference.seal_pages_ref(v_cache, seal_slots)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    k_scale: Scale = None,
    v_scale: Scale = None,
    order: torch.Tensor | None = None,  # [num_seqs] int32: the Triton kernel's program order (same output)
) -> torch.Tensor:
    if use_triton(q):
        from nvcli.kernels.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                                             order=order)
    return reference.paged_decode_attention_ref(
        q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale
    )


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
    k_scale: Scale = None,
    v_scale: Scale = None,
    invariant: bool = False,  # the Triton kernel's --batch-invariant form (the reference's rows are computed apart)
) -> torch.Tensor:
    if use_triton(q):
        from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len, scale,
            k_scale, v_scale, invariant=invariant,
        )
    return reference.paged_attention_ref(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, k_scale, v_scale
    )
