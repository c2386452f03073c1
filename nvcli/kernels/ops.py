"""Kernel entry points used by the model: Triton on CUDA tensors, the torch reference elsewhere.

The model layers, attention (nvcli/attention/) and the sampler ask `use_triton` too: one rule for every kernel.

A layer's cache is one `PagedKV` (kv_layout.py). Its k_scale / v_scale are the per-tensor scales of an fp8 KV
cache (None = 1.0, a float or a 1-element float32 tensor; tensors are read on the device, so CUDA graphs may capture
them): the store writes clamp(x / scale, +-fp8 max) and attention reads cache * scale. Caches of any other dtype
ignore them.
"""

from __future__ import annotations

import torch

from nvcli.kernels import reference
from nvcli.kernels.kv_layout import PagedKV


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s computation goes to a Triton kernel: on CUDA; elsewhere the torch reference runs."""
    return t.is_cuda


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv: PagedKV,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    if use_triton(key):
        from nvcli.kernels.kv_store import store_kvcache_triton

        store_kvcache_triton(key, value, kv, slot_mapping)
    else:
        reference.store_kvcache_ref(key, value, kv, slot_mapping)


def seal_pages(kv: PagedKV, seal_slots: torch.Tensor) -> None:
    """After a step's store: turn dims-major the pages it filled, those whose last slot is in `seal_slots`
    (kv_layout.py, open pages); a no-op for caches that are not dims-major."""
    if use_triton(seal_slots):
        from nvcli.kernels.kv_store import seal_pages_triton

        seal_pages_triton(kv, seal_slots)
    else:
        reference.seal_pages_ref(kv, seal_slots)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv: PagedKV,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    order: torch.Tensor | None = None,  # [num_seqs] int32: the Triton kernel's program order (same output)
) -> torch.Tensor:
    if use_triton(q):
        from nvcli.kernels.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, kv, block_tables, seq_lens, scale, order=order)
    return reference.paged_decode_attention_ref(q, kv, block_tables, seq_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: PagedKV,
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    invariant: bool = False,  # the Triton kernel's --batch-invariant form (the reference's rows are computed apart)
) -> torch.Tensor:
    if use_triton(q):
        from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            q, kv, query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len, scale, invariant=invariant,
        )
    return reference.paged_attention_ref(q, kv, query_start_loc, seq_lens, block_tables, scale)
