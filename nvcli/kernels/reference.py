"""Pure-torch references for the paged KV cache and attention kernels.

Layouts shared by every implementation:
- KV cache, one `PagedKV` per layer: K and V `[num_blocks, block_size, num_kv_heads, head_dim]`, addressed
  through their strides (V may be a dims-major view, see `kv_layout.py`), and the fp8 scales.
- slot of a token = block_id * block_size + offset inside the block; slot -1 is skipped
  (padding in CUDA-graph batches).
- block_tables: `[num_seqs, max_blocks_per_seq]` int32, rows padded with any valid id.
- A step's queries are packed: sequence s owns rows query_start_loc[s] : query_start_loc[s+1]
  and its KV length after this step is seq_lens[s], so query row j of s sits at position
  seq_lens[s] - q_len + j and attends causally to KV positions [0, that position].
- A dims-major V cache keeps each sequence's open (last, partial) page token-major: stores write through
  the open-page view (`PagedKV.v_open`), `seal_pages_ref` turns the pages a step filled dims-major, and readers take the open page
  from the token-major view (`kv_layout.py`, open pages).
- fp8 caches (`torch.float8_e4m3fn` / `float8_e5m2`) hold `clamp(x / scale, -max, max)` cast with
  round-to-nearest (NaN stored as 0, so no slot ever holds a NaN), one scale per tensor (k_scale, v_scale: None = 1.0, a float or a 1-element
  tensor); attention reads `cache.float() * scale`. Other caches ignore the scales: the store
  casts to the cache dtype and attention upcasts to float32.
"""

from __future__ import annotations

import torch

from nvcli.kernels.kv_layout import PagedKV, Scale


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _scale(s: Scale) -> float | torch.Tensor:
    """A per-tensor scale as something that broadcasts against a float32 tensor."""
    if s is None:
        return 1.0
    if isinstance(s, torch.Tensor):
        assert s.numel() == 1, "per-tensor scale must have one element"
        return s.reshape(()).float()
    return float(s)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: Scale = None) -> torch.Tensor:
    """x as stored in a cache of `dtype`: fp8 saturates x / scale (float32 division) and stores NaN as 0,
    else a cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return torch.nan_to_num(x.float() / _scale(scale), nan=0.0).clamp(-fmax, fmax).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: Scale = None) -> torch.Tensor:
    """Cache contents as float32: fp8 times its scale, anything else upcast."""
    if not is_fp8(x.dtype):
        return x.float()
    return x.float() * _scale(scale)


def store_kvcache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv: PagedKV,
    slot_mapping: torch.Tensor,  # [num_tokens] int
) -> None:
    bs = kv.block_size
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // bs, slots % bs  # indexing, not a flat view: the caches may be strided views
    kv.k[blocks, offsets] = quantize_kv(key[valid], kv.dtype, kv.k_scale)
    kv.v_open[blocks, offsets] = quantize_kv(value[valid], kv.dtype, kv.v_scale)


def seal_pages_ref(kv: PagedKV, seal_slots: torch.Tensor) -> None:
    """Turn the pages that this step filled dims-major: the page of every slot that is its page's last
    (slot % block_size == block_size - 1; others and -1 are ignored). No-op unless V is dims-major."""
    if not kv.v_dims_major:
        return
    bs = kv.block_size
    slots = seal_slots.long()
    blocks = (slots[(slots >= 0) & (slots % bs == bs - 1)] // bs).unique()
    kv.v[blocks] = kv.v_open[blocks].clone()


def _gather_kv(cache: torch.Tensor, open_view: torch.Tensor | None, block_table: torch.Tensor,
               seq_len: int) -> torch.Tensor:
    """A sequence's `[seq_len, num_kv_heads, head_dim]` rows of `cache` (a copy); `open_view`: the token-major view
    of a dims-major cache, where its open page is read."""
    bs = cache.shape[1]
    nblocks = -(-seq_len // bs)
    blocks = cache[block_table[:nblocks].long()]  # [nblocks, block_size, num_kv_heads, head_dim] (a copy)
    out = blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]
    open_start = seq_len // bs * bs
    if open_start < seq_len and open_view is not None:  # the open page is token-major
        out[open_start:] = open_view[block_table[seq_len // bs].long(), : seq_len - open_start]
    return out


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: PagedKV,
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries over the paged cache; float32 math (fp8 dequantised)."""
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    num_kv_heads = kv.num_kv_heads
    v_open = kv.v_open if kv.v_dims_major else None
    group = num_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_s = q[qsl[s] : qsl[s + 1]].float()  # [q_len, num_heads, head_dim]
        q_len = q_s.shape[0]
        if q_len == 0:
            continue
        k = dequantize_kv(_gather_kv(kv.k, None, block_tables[s], seq_len), kv.k_scale)  # [seq_len, kv_heads, dim]
        v = dequantize_kv(_gather_kv(kv.v, v_open, block_tables[s], seq_len), kv.v_scale)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_s, k) * scale  # [num_heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qsl[s] : qsl[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query per sequence
    kv: PagedKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    qsl = torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32)
    return paged_attention_ref(q, kv, qsl, seq_lens, block_tables, scale)
