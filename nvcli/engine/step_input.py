"""One step's inputs as plain lists and arrays: what rank 0 builds from the scheduler's batch and ships to
tensor-parallel workers, and what the model runner turns into tensors (eagerly, or staged into a CUDA graph).

Invariant: a token still being sampled by the step in flight (PENDING in the sequence) is 0 in input_ids, and its
(input row, that step's row) is in `pending`; the runner writes it on the device from the sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from nvcli.engine.scheduler import PENDING, ScheduledBatch

if TYPE_CHECKING:
    from nvcli.engine.sequence import Sequence

# Token-level columns of a step: lists for decode steps (one token per sequence, where Python lists are
# cheapest), numpy int64 arrays for steps that carry prompt chunks (16k tokens: per-token Python costs ms).
Ints = list[int] | np.ndarray
# The final norm's inputs of some rows: (hidden, residual) [rows, hidden] each; residual None under the deferred norm
Final = tuple[torch.Tensor, torch.Tensor | None]


@dataclass
class StepInput:
    """Everything a rank needs to run one step; small lists or arrays, cheap to ship to TP workers."""

    input_ids: Ints
    positions: Ints
    slot_mapping: Ints
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    decode_only: bool
    # Input rows whose token the previous (still running) step samples: (input row, that step's row).
    pending: list[tuple[int, int]] = field(default_factory=list)
    # A step with prompt chunks: its leading sequences that compute one token each (decode kernel rows)
    num_decode_rows: int = 0
    # Token rows whose logits are wanted besides each sequence's last (prompt_logprobs), in the batch's span order
    logit_rows: Ints = field(default_factory=list)
    # Token rows sampled besides each sequence's last: a verify sequence's k rows before its last (speculative
    # decoding, engine/spec_decode.py), in batch order; their logits follow the sequences' own rows
    draft_rows: Ints = field(default_factory=list)


def _feeding_row(seq: Sequence, prev_rows: dict[int, int] | None) -> int:
    """The row of the step in flight whose sampled token is `seq`'s PENDING input."""
    if prev_rows is None:
        raise RuntimeError("a step input waits for a token but no step is in flight")
    return prev_rows[seq.seq_id]


def build_step_input(batch: ScheduledBatch, block_size: int, prev_rows: dict[int, int] | None = None) -> StepInput:
    """`prev_rows`: seq_id -> row of the step in flight, whose sampled tokens feed PENDING inputs."""
    if not batch.is_decode_only:
        return _build_chunked_step_input(batch, block_size, prev_rows)
    input_ids, slots, seq_lens, pending = _one_token_columns(batch.seqs, batch.start, block_size, prev_rows)
    return StepInput(input_ids, list(batch.start), slots, list(range(len(batch.seqs) + 1)), seq_lens,
                     [s.block_table for s in batch.seqs], True, pending)


def _one_token_columns(seqs: list[Sequence], positions: list[int], block_size: int, prev_rows: dict[int, int] | None
                       ) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
    """(input ids, cache slots, lengths, pending rows) of rows that compute one token each, at `positions`: a
    decode-only step, or the leading rows of a step with prompt chunks. A token still in flight is 0 here, and its
    (row, row of the step in flight) is in pending."""
    input_ids = [seq.token_ids[pos] for seq, pos in zip(seqs, positions)]
    pending: list[tuple[int, int]] = []
    for row, token in enumerate(input_ids):
        if token == PENDING:
            pending.append((row, _feeding_row(seqs[row], prev_rows)))
            input_ids[row] = 0
    slots = [seq.block_table[pos // block_size] * block_size + pos % block_size for seq, pos in zip(seqs, positions)]
    return input_ids, slots, [pos + 1 for pos in positions], pending


def _build_chunked_step_input(batch: ScheduledBatch, block_size: int, prev_rows: dict[int, int] | None) -> StepInput:
    """build_step_input for a step with prompt chunks: the token-level columns as numpy arrays. The leading one-token
    rows (a long job's running decodes, often hundreds) are gathered as lists in one pass; only prompt chunks take
    the per-sequence numpy slices (1.65 -> 0.10 ms of host for 157 decode rows and one prompt on the CPU machine)."""
    d = batch.num_single_token_rows
    qsl = list(range(d + 1))
    for n in batch.num_new_tokens[d:]:
        qsl.append(qsl[-1] + n)
    num_tokens = qsl[-1]
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slots = np.empty(num_tokens, dtype=np.int64)
    input_ids[:d], slots[:d], seq_lens, pending = _one_token_columns(batch.seqs[:d], batch.start[:d], block_size,
                                                                     prev_rows)
    positions[:d] = batch.start[:d]
    for seq, start, n, row_start in zip(batch.seqs[d:], batch.start[d:], batch.num_new_tokens[d:], qsl[d:]):
        end = start + n
        rows = slice(row_start, row_start + n)
        input_ids[rows] = seq.token_ids[start:end]
        if input_ids[row_start + n - 1] == PENDING:
            pending.append((row_start + n - 1, _feeding_row(seq, prev_rows)))
            input_ids[row_start + n - 1] = 0
        pos = np.arange(start, end, dtype=np.int64)
        positions[rows] = pos
        table = np.asarray(seq.block_table[start // block_size : (end - 1) // block_size + 1], dtype=np.int64)
        slots[rows] = table[pos // block_size - start // block_size] * block_size + pos % block_size
        seq_lens.append(end)
    logit_rows: Ints = []
    if batch.prompt_logit_spans:  # position p of sequence i sits at row qsl[i] + p - start[i]
        logit_rows = np.concatenate([np.arange(qsl[i] + lo - batch.start[i], qsl[i] + hi - batch.start[i])
                                     for i, lo, hi in batch.prompt_logit_spans])
    draft_rows: Ints = []
    if batch.num_drafts:  # sequence i's k drafts are the inputs of its k rows before its last, which end at qsl[i + 1]
        draft_rows = [row for i, k in enumerate(batch.num_drafts) if k for row in range(qsl[i + 1] - 1 - k, qsl[i + 1] - 1)]
    return StepInput(input_ids, positions, slots, qsl, seq_lens, [s.block_table for s in batch.seqs], False, pending, d,
                     logit_rows, draft_rows)
