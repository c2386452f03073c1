"""Two-batch overlap: a big decode step as two halves, one half's attention beside the other's GEMMs.

A decode step at 128+ sequences is mostly attention, which streams the KV cache at the memory's
bandwidth, and the rest (projections, norms, rotary, MLP) is a chain of small kernels that are bound
by latency and leave most of that bandwidth unused. Run as one batch, the two alternate and the
chain's ~60 us per layer adds to the step. Run as two halves, the attention kernels of both halves
go, in turn, on one stream (A0 B0 A1 B1 ...), and everything else on a second, higher-priority
stream: while half B's attention of layer L streams its KV, half A does its o_proj and MLP of layer
L and its qkv of layer L+1, so A's attention of layer L+1 is ready when B's ends.

    attention stream:  A0 | B0 | A1 | B1 | ...
    other stream:      a0 b0 | a0' a1 | b0' b1 | a1' a2 | ...   (x: up to attention, x': after it)

The weights are read twice (once per half), which is why small batches, whose steps are mostly that
chain, run as one. Correctness does not depend on the overlap: each half is the model's forward on
its rows.

Memory: a tensor made on one stream and read on the other (q, the attention output) is read only
by kernels that the maker's stream waits for before it makes anything else; the caching allocator
reuses a freed block only for the stream that allocated it, so no block is rewritten while the
other stream may still read it, in eager runs and in CUDA-graph capture alike.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from typing import Protocol

import torch

from nvcli.engine.attention_metadata import AttentionMetadata

# Decode graphs of at least this many rows run as two halves (0: never). NV_OVERLAP_MIN_BATCH overrides
# it for A/B runs.
OVERLAP_MIN_BATCH = int(os.environ.get("NV_OVERLAP_MIN_BATCH", "128"))
OVERLAP_PRIORITY = os.environ.get("NV_OVERLAP_PRIORITY", "gemm")


class StagedModel(Protocol):
    def forward_stages(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> Generator[torch.Tensor, None, tuple[torch.Tensor, torch.Tensor]]: ...


def decode_rows(meta: AttentionMetadata, start: int, end: int) -> AttentionMetadata:
    """The metadata of rows [start, end) of a decode step (views, no kernels)."""
    if not meta.decode_only:
        raise ValueError("only decode steps split into halves: their query rows are one per sequence")
    n = end - start
    # a decode step's query_start_loc is 0, 1, ..., num_seqs: its first n + 1 entries serve any n rows
    return AttentionMetadata(meta.slot_mapping[start:end], meta.query_start_loc[: n + 1], meta.seq_lens[start:end],
                             meta.block_tables[start:end], 1, meta.max_seq_len, True)


class DecodeOverlap:
    """Runs decode steps as two overlapped halves on `device` (CPU: the same stages one after another,
    which tests use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gemm_stream: torch.cuda.Stream | None = None
        self.attn_stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            # Which stream's kernels the block scheduler serves first when an SM frees up
            # (NV_OVERLAP_PRIORITY: gemm, attention or none).
            first = OVERLAP_PRIORITY
            self.gemm_stream = torch.cuda.Stream(device, priority=-1 if first == "gemm" else 0)
            self.attn_stream = torch.cuda.Stream(device, priority=-1 if first == "attention" else 0)

    def forward(
        self, model: StagedModel, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        split: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's (hidden, residual) [num_seqs, hidden] for a decode step, rows [0, split) and
        [split, num_seqs) as two halves, ordered after the current stream's work and before its next."""
        num_seqs = input_ids.shape[0]
        if not 0 < split < num_seqs:
            raise ValueError(f"split {split} must leave rows in both halves of {num_seqs}")
        bounds = [(0, split), (split, num_seqs)]
        halves = [model.forward_stages(input_ids[a:b], positions[a:b], decode_rows(meta, a, b)) for a, b in bounds]
        gemm, attn = self.gemm_stream, self.attn_stream
        main = torch.cuda.current_stream(self.device) if gemm is not None else None
        if gemm is not None:
            gemm.wait_stream(main)
            attn.wait_stream(main)
        results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        attention_done: list[torch.cuda.Event | None] = [None, None]
        while any(r is None for r in results):
            for i, half in enumerate(halves):
                if results[i] is not None:
                    continue
                with self._on(gemm):
                    if attention_done[i] is not None:
                        gemm.wait_event(attention_done[i])
                    try:
                        next(half)  # up to the next attention: q is ready
                    except StopIteration as stop:
                        results[i] = stop.value
                        continue
                with self._on(attn):
                    if gemm is not None:
                        attn.wait_stream(gemm)
                    next(half)  # the attention kernel
                    if gemm is not None:
                        attention_done[i] = torch.cuda.Event()
                        attention_done[i].record(attn)
        if gemm is not None:
            main.wait_stream(gemm)
            main.wait_stream(attn)
        (h0, r0), (h1, r1) = results  # type: ignore[misc]
        return torch.cat([h0, h1]), torch.cat([r0, r1])

    @staticmethod
    def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
