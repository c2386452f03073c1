"""The one object that tells attention where a step's tokens live in the paged KV cache, and how to read them.

Built by the attention backend (attention/backend.py) for eager steps and by the CUDA-graph room over its static
buffers; the model's layers pass it through untouched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class DecodeSplit:
    """A step that carries prompt chunks beside one-token rows (a long job's steady state: running sequences
    decode while new prompts are admitted). The one-token rows come first (the scheduler orders them so) and go to
    the decode kernel; the prompt chunks' rows go to the prefill kernel, whose query tiles would otherwise hold one
    real row per decode sequence. GPU only: the torch reference reads the whole-step fields of AttentionMetadata."""

    num_rows: int  # rows [0, num_rows) of q for the decode kernel; in a CUDA graph its capacity, unused rows length 0
    seq_lens: torch.Tensor  # [num_rows] int32, KV length of each one-token row (0: unused)
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32
    order: torch.Tensor  # [num_rows] int32 permutation, longest first (decode kernel program order)
    prefill_query_start_loc: torch.Tensor  # [num_prefill + 1] int32, absolute rows: starts after the one-token rows
    prefill_seq_lens: torch.Tensor  # [num_prefill] int32 (0: unused entry of a graph)
    prefill_block_tables: torch.Tensor  # [num_prefill, max_blocks] int32
    prefill_max_query_len: int  # bound on the prompt chunks' lengths (a graph: its token count)
    # the one-token rows' shared tokens, per group of rows (int32, AttentionMetadata.shared_prefix_len): read once per
    # group; None: the ordinary decode kernel
    shared_prefix_len: Optional[torch.Tensor] = None


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
    split: Optional[DecodeSplit] = None  # a step with prompt chunks and one-token rows, on the GPU
    # Decode steps on the GPU whose sequences begin with shared cached pages: int32, [1] or one per group of rows in
    # decode_order (attention/plan.shared_prefix_plan), that many tokens (whole pages, fewer than any of the
    # group's lengths) are read once for the group (kernels/shared_prefix_attention.py); None: the ordinary kernel
    shared_prefix_len: Optional[torch.Tensor] = None
    # --batch-invariant on the GPU: every row, one-token or prompt, through the prefill kernel's one tile shape, and
    # the rotary step as its own kernel, so a row's arithmetic never depends on the other rows of its step
    invariant: bool = False
