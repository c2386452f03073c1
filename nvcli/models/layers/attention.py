"""Paged attention layer: holds a layer's paged KV cache (one PagedKV: pages and fp8 scales); one forward, whose
kernel calls are the attention backend's (nvcli/attention/forward.py)."""

from __future__ import annotations

import torch
from torch import nn

from nvcli.attention.forward import HeadNorm, Rotary, paged_attention
from nvcli.attention.metadata import AttentionMetadata
from nvcli.kernels.kv_layout import PagedKV


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the cache is allocated (engine/kv_sizing.py). Kernels and captured CUDA
        # graphs read its pages and fp8 scales in place, so the binding is not replaced once graphs are captured.
        self.kv: PagedKV | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], raw projections
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        rotary: Rotary,
        q_norm: HeadNorm | None = None,
        k_norm: HeadNorm | None = None,
        scale_rows: torch.Tensor | None = None,
        scale_eps: float = 1e-6,
        qkv_ratios: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Per-head norm and rotary of q and k, the KV store, then attention over the cache (attention/forward.py)."""
        return paged_attention(self, q, k, v, positions, meta, rotary, q_norm, k_norm, scale_rows, scale_eps,
                               qkv_ratios)
