"""Paged attention layer: writes this step's K/V into the cache (sealing the pages it filled), then attends over
it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nvcli.engine.attention_metadata import AttentionMetadata
from nvcli.kernels import ops

if TYPE_CHECKING:
    from nvcli.kernels.decode_attention import DecodeRope


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the cache is allocated: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Per-tensor scales of an fp8 cache (ignored by other dtypes): stored = clamp(x / scale), read
        # back as stored * scale. 1-element float32 buffers on the model's device, set once by the model
        # runner (fill_, never reassigned) so kernels and captured CUDA graphs read them in place.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_stored: bool = False,  # the caller's fused rotary kernel already wrote k and v to the cache
        invariant: bool = False,  # --batch-invariant (GPU): every row, decode or prompt, by the prefill kernel
    ) -> torch.Tensor:
        if not kv_stored:
            ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        # A page is full once its last slot is written, so this step's slots name the pages it filled (kv_layout.py)
        ops.seal_pages(self.v_cache, meta.slot_mapping)
        if meta.split is not None:
            return ops.paged_split_attention(q, self.k_cache, self.v_cache, meta.split, self.scale, self.k_scale,
                                             self.v_scale, invariant=invariant)
        if meta.decode_only and not invariant:
            if meta.shared_prefix_len is not None:  # GPU only: the model runner's decode graphs
                from nvcli.kernels.shared_prefix_attention import shared_prefix_decode_attention_triton

                return shared_prefix_decode_attention_triton(q, self.k_cache, self.v_cache, meta.block_tables,
                                                             meta.seq_lens, meta.shared_prefix_len, self.scale,
                                                             meta.decode_order, k_scale=self.k_scale,
                                                             v_scale=self.v_scale)
            return ops.paged_decode_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale,
                self.k_scale, self.v_scale, meta.decode_order,
            )
        return ops.paged_prefill_attention(
            q, self.k_cache, self.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, meta.max_seq_len, self.scale, self.k_scale, self.v_scale, invariant=invariant,
        )

    def decode_with_rope(self, q: torch.Tensor, rope: DecodeRope, meta: AttentionMetadata) -> torch.Tensor:
        """Decode attention (GPU) whose kernel first norms and rotates q and the new key and stores the
        new key and value (and seals the page that the new token fills)."""
        from nvcli.kernels.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                             self.scale, self.k_scale, self.v_scale, rope=rope,
                                             order=meta.decode_order)
