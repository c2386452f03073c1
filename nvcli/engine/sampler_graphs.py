"""Sampling inside CUDA graphs, for decode steps of a few rows.

One request that samples is bound by the host on machines with a slower CPU: its step's GPU
work is about 0.87 ms, and the host spent 0.82-1.2 ms launching it, 0.3 ms more than a greedy step. That 0.3 ms is
the sampler's eager launches (a Triton launch costs tens of microseconds of Python; top-k / top-p make three of them)
and four uploads of per-row values. So decode steps of up to `MAX_ROWS` rows compute their logits inside the decode
graph (model_runner) and sample by replaying one more graph, captured per graph size and kind:

- `greedy` (every row greedy): argmax;
- `temperature` (no row filters): the fused sampler (kernels/sampling.py);
- `filtered` (some row uses top-k, top-p or min-p): the filter floors (kernels/sampling_filters.py), then the fused
  sampler above them. A row without a filter passes the values that mean none (top_k = vocab, top_p = 1, min_p = 0),
  which the floor kernel treats as the eager path's absent tensors.

The graphs read their per-row values from one static device buffer that a step fills with a single copy from pinned
staging memory. The values are the eager sampler's (sampler.RowValues) and the kernels the same, so a seeded request
draws the same tokens either way. Rows a graph pads past the step are greedy. Steps with logit_bias, penalties,
min_tokens bans or structured-output masks sample eagerly from the graph's logits (model_runner decides).
"""

from __future__ import annotations

import numpy as np
import torch

from nvcli.engine.sampler import RowValues
from nvcli.engine.staging import PinnedTurns

# Decode steps of up to this many rows sample inside CUDA graphs. Larger steps keep the GPU busy for longer than the
# host takes to launch them (2 ms and more from 17 rows of Qwen3-0.6B on an H100).
MAX_ROWS = 16
KINDS = ("greedy", "temperature", "filtered")


def kind_of(values: RowValues) -> str:
    """The sampler graph a batch with these per-row values replays."""
    if values.all_greedy:
        return "greedy"
    return "filtered" if values.filtered else "temperature"


def stage_row_values(f32: np.ndarray, i64: np.ndarray, values: RowValues, rows: int, vocab_size: int) -> str:
    """Write a step's per-row values into a graph's staged inputs: `f32` [3, >= rows] (temperatures, top_p, min_p),
    `i64` [2, >= rows] (noise seeds, top_k) -> the batch's kind (kind_of). The rows past the step's (padding) are
    greedy; a filter no row uses, or a row does not use, gets the value that means none (top_p 1, min_p 0, top_k the
    vocab size). Only what the batch's kind reads is written."""
    n = len(values.temperatures)
    kind = kind_of(values)
    f32[0, :n] = values.temperatures
    f32[0, n:rows] = 0.0
    if kind == "greedy":
        return kind
    assert values.philox is not None, "a sampled row needs its noise seed"
    i64[0, :n] = values.philox
    if kind == "filtered":
        f32[1, :rows] = 1.0 if values.top_p is None else np.pad(values.top_p, (0, rows - n), constant_values=1.0)
        f32[2, :rows] = 0.0 if values.min_p is None else np.pad(values.min_p, (0, rows - n))
        i64[1, :rows] = (vocab_size if values.top_k is None
                         else np.pad(values.top_k, (0, rows - n), constant_values=vocab_size))
    return kind


class SamplerGraphs:
    """The sampler graphs of every decode graph size up to `max_rows`, their static inputs and outputs."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        # byte layout: float32 [3, max_rows] (temperatures, top_p, min_p) | int64 [2, max_rows] (noise seeds, top_k)
        self._f32_bytes = -(-3 * max_rows * 4 // 8) * 8
        size = self._f32_bytes + 2 * max_rows * 8
        self.blob = torch.zeros(size, dtype=torch.uint8, device=device)
        self.f32, self.i64 = self._views(self.blob)
        # Two pinned staging copies used in turn, as the graphs' inputs are (engine/staging.py): step N+1 is staged
        # while step N's copy may still be queued on the device
        self.turns = PinnedTurns(size, device)
        self.stages = [tuple(t.numpy() for t in self._views(b)) for b in self.turns.blobs]
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.tokens: dict[tuple[int, str], torch.Tensor] = {}  # [rows] int64, rewritten by every replay

    @property
    def num_steps(self) -> int:
        """Replays so far."""
        return self.turns.turn

    def _views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.max_rows
        return (blob[: 3 * r * 4].view(torch.float32).view(3, r),
                blob[self._f32_bytes :].view(torch.int64).view(2, r))

    def _run(self, kind: str, logits: torch.Tensor) -> torch.Tensor:
        """Sample `logits` [rows, vocab] from the static per-row values -> [rows] int64."""
        from nvcli.kernels.sampling import sample_triton
        from nvcli.kernels.sampling_filters import filter_floors_triton

        rows = logits.shape[0]
        temps, top_p, min_p = self.f32[0, :rows], self.f32[1, :rows], self.f32[2, :rows]  # [rows] each
        seeds, top_k = self.i64[0, :rows], self.i64[1, :rows]  # [rows] each
        if kind == "greedy":
            return logits.argmax(dim=-1)
        floors = filter_floors_triton(logits, temps, top_k, top_p, min_p) if kind == "filtered" else None
        return sample_triton(logits, temps, seeds, floors)

    def capture(self, logits: torch.Tensor, pool: tuple[int, int] | None) -> None:
        """Capture the three kinds for a decode graph whose logits are `logits` [rows, vocab] (its static output).

        Through CUDAGraph.capture_begin / capture_end on a side stream, as torch.cuda.graph does, without its
        synchronize, gc.collect and empty_cache before each capture: those made the 15 sampler graphs of a start-up
        cost 0.6-1.1 s."""
        rows = logits.shape[0]
        assert rows <= self.max_rows
        side = torch.cuda.Stream(logits.device)
        for kind in KINDS:
            self._run(kind, logits)  # eager first: a Triton variant compiles outside the graph
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                graph.capture_begin(pool=pool)
                try:
                    self.tokens[rows, kind] = self._run(kind, logits)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            self.graphs[rows, kind] = graph

    def sample(self, rows: int, values: RowValues) -> torch.Tensor:
        """Replay the graph of `rows` rows (a captured size) for a step whose first len(values.temperatures) rows are
        live -> its tokens [rows] int64 (the caller keeps the live ones). Enqueued on the current stream."""
        turn = self.turns.next()
        f32, i64 = self.stages[turn]
        kind = stage_row_values(f32, i64, values, rows, self.vocab_size)
        self.blob.copy_(self.turns.blobs[turn], non_blocking=True)  # a few hundred bytes: one copy's latency
        self.turns.uploaded(turn)
        self.graphs[rows, kind].replay()
        return self.tokens[rows, kind]
