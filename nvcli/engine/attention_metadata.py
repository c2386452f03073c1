"""The one object that tells attention where this step's tokens live in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (-1: padding, skipped)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, packed query rows of each sequence
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length of each sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every sequence has exactly one query token (decode kernel, CUDA graphs)
    # [num_seqs] int32 permutation, longest sequence first: the order decode attention's programs take the
    # sequences in (decode graphs; None: batch order)
    decode_order: Optional[torch.Tensor] = None
