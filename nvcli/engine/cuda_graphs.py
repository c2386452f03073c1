"""CUDA graphs: every family of graphs is keyed, captured and replayed through one path.

A graph is keyed by GraphKey(tokens, chunks, shared):
- decode graphs (chunks 0): one token per sequence, at graph_batch_sizes rows. Those of up to
  sampler_graphs.MAX_ROWS rows end with the LM head, and rank 0 samples their logits in graphs too
  (engine/sampler_graphs.py); not under tensor parallelism, whose LM head gathers across ranks.
- mixed graphs (chunks > 0): prompt chunks beside one-token rows (a long job's steady state, where new lines join
  most steps), at mixed_graph_sizes tokens. Launched eagerly such a step cost the host ~27 ms against ~8 ms of GPU
  work. A mixed graph's prefill-attention grid is sized for its chunk capacity (half its tokens): graphs of up to
  MIXED_FEW_MAX_TOKENS tokens get a second capture of MIXED_FEW_CHUNKS chunks for the one or two real chunks of a
  typical step (a 768-token graph launched ~3,100 programs per layer otherwise: 39 against 21 us per layer).
- shared (either family): the one-token rows read a prefix they share once per group of rows
  (attention/plan.py), captured the first time a step needs one.

Static inputs (engine/staging.py), one layout per family: int64 [3, tokens] (input ids, positions, cache slots),
for mixed graphs int64 [rows + chunks] (each sequence's last row), then the attention backend's fields. Capture runs
over inputs that read and write no KV (slots -1, lengths 0), eagerly once first: nothing may initialize inside a
capture. Every graph shares one memory pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from nvcli.attention.plan import SHARED_PREFIX_MIN_ROWS
from nvcli.engine.staging import StagingLayout

if TYPE_CHECKING:
    from nvcli.attention.backend import AttentionBackend
    from nvcli.engine.sampler_graphs import SamplerGraphs
    from nvcli.engine.step_input import Final, StepInput

MIXED_FEW_CHUNKS = 8
MIXED_FEW_MAX_TOKENS = 2048
# A decode step whose staged inputs (tables included) fit in this many bytes uploads them in one H2D copy.
SINGLE_UPLOAD_BYTES = 64 << 10


class GraphKey(NamedTuple):
    tokens: int  # rows of the graph's forward (a decode graph: its sequences)
    chunks: int = 0  # prompt-chunk capacity; 0: a decode graph
    shared: bool = False  # one-token rows read a shared prefix once per group


@dataclass
class Graph:
    graph: torch.cuda.CUDAGraph
    outputs: Final  # (hidden, residual) [tokens, hidden] in the pool, rewritten by every replay
    logits: torch.Tensor | None  # [tokens, vocab]: decode graphs that end with the LM head


@dataclass
class Replayed:
    key: GraphKey
    final: Final  # each sequence's last row
    outputs: Final  # every row of the graph (a mixed step's prompt_logprobs rows are read from it)
    logits: torch.Tensor | None  # [num_seqs, vocab] where the graph ends with the LM head


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph; a step replays the smallest one that fits."""
    top = min(max_num_seqs, 512)
    sizes = [1, 2, 4, 8] + list(range(16, top + 1, 16))
    return sorted({s for s in sizes if s <= top} | {top})


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of steps with prompt chunks that get a CUDA graph; a step replays the smallest one that fits
    (its padding rows cost GEMM rows: at most a quarter more). Eagerly the host takes 20-30 ms to launch such a
    step at any size, which only steps of more than ~8,192 tokens keep the GPU busy for."""
    sizes = ([64, 128] + list(range(256, 1025, 128)) + list(range(1280, 2049, 256)) + list(range(2560, 4097, 512))
             + list(range(5120, 8193, 1024)))
    return [s for s in sizes if s <= max_num_batched_tokens]


class CudaGraphs:
    def __init__(self, model: torch.nn.Module, attention: AttentionBackend, device: torch.device, max_num_seqs: int,
                 max_num_batched_tokens: int, shared_prefix: bool, logits_max_rows: int) -> None:
        """`shared_prefix`: whether shared-prefix variants may be captured; `logits_max_rows`: decode graphs of up to
        that many rows end with the LM head (0: none)."""
        self.model = model
        self.attention = attention
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.decode_sizes = graph_batch_sizes(max_num_seqs)
        self.mixed_sizes = mixed_graph_sizes(max_num_batched_tokens)
        self.shared_prefix = shared_prefix
        self.logits_max_rows = logits_max_rows
        self.graphs: dict[GraphKey, Graph] = {}
        self.pool: tuple[int, int] | None = None
        self.sampler_graphs: SamplerGraphs | None = None
        self.replays: Counter[str] = Counter()  # by family: "decode", "mixed"
        self.single_upload_bytes = SINGLE_UPLOAD_BYTES
        self.few_chunks = MIXED_FEW_CHUNKS
        self.layouts: dict[str, StagingLayout] = {}
        self.dev: dict[str, dict[str, torch.Tensor]] = {}  # by family: the device views, attention's parts cut
        self.host: dict[str, list[dict[str, np.ndarray]]] = {}  # by family: each staging buffer's numpy views

    # ------------------------------------------------------------------ keys
    def capacity(self, tokens: int) -> tuple[int, int]:
        """(one-token rows, prompt chunks) a mixed graph of `tokens` rows holds at most: a prompt chunk has 2+ tokens
        (the scheduler's one-token rows are decode rows)."""
        return min(tokens, self.max_num_seqs), max(1, min(self.max_num_seqs, tokens // 2))

    def rows_of(self, key: GraphKey) -> int:
        return key.tokens if not key.chunks else self.capacity(key.tokens)[0]

    def keys(self) -> list[GraphKey]:
        """The graphs a start-up captures, largest first in each family (the first capture sizes the pool)."""
        keys = [GraphKey(bs) for bs in reversed(self.decode_sizes)]
        for tokens in reversed(self.mixed_sizes):
            chunks = self.capacity(tokens)[1]
            keys.append(GraphKey(tokens, chunks))
            if 0 < self.few_chunks < chunks and tokens <= MIXED_FEW_MAX_TOKENS:
                keys.append(GraphKey(tokens, self.few_chunks))
        return keys

    def shared_keys(self) -> list[GraphKey]:
        """Shared-prefix variants a job may capture: every decode size that may take the kernel, and one mixed key
        per one-token-row capacity (the kernel's variants differ by row count: what compile-ahead must see)."""
        if not self.shared_prefix:
            return []
        keys = [GraphKey(bs, 0, True) for bs in self.decode_sizes if bs >= SHARED_PREFIX_MIN_ROWS]
        by_rows = {self.rows_of(k): k for k in self.keys() if k.chunks}
        return keys + [k._replace(shared=True) for rows, k in by_rows.items() if rows >= SHARED_PREFIX_MIN_ROWS]

    def key_for(self, step: StepInput) -> GraphKey | None:
        """The graph that replays `step`: the smallest that holds it (fewest tokens, then fewest chunks), without its
        shared variant (the step's staging decides that); None where none was captured or fits (eager)."""
        if not self.graphs:
            return None
        if step.decode_only:
            bs = len(step.seq_lens)
            if bs > self.decode_sizes[-1]:
                return None
            return GraphKey(next(s for s in self.decode_sizes if s >= bs))
        num_tokens = len(step.input_ids)
        if (not self.mixed_sizes or num_tokens > self.mixed_sizes[-1]
                or max(len(b) for b in step.block_tables) > self.attention.max_blocks):
            return None
        tokens = next(s for s in self.mixed_sizes if s >= num_tokens)
        d_cap, p_cap = self.capacity(tokens)
        if step.num_decode_rows > d_cap or len(step.seq_lens) - step.num_decode_rows > p_cap:
            return None
        few = GraphKey(tokens, self.few_chunks)
        return few if len(step.seq_lens) - step.num_decode_rows <= self.few_chunks and few in self.graphs else (
            GraphKey(tokens, p_cap))

    # ------------------------------------------------------------------ inputs and forwards
    def make_inputs(self) -> None:
        """The static inputs of both families (once; compile-ahead runs the same forwards before capture)."""
        if self.layouts:
            return
        top = self.decode_sizes[-1]
        families = {"decode": ([("i64", torch.int64, (3, top))], top, 0)}
        if self.mixed_sizes:
            tokens = self.mixed_sizes[-1]
            rows, chunks = self.capacity(tokens)
            families["mixed"] = ([("i64", torch.int64, (3, tokens)), ("last", torch.int64, (rows + chunks,))], rows,
                                 chunks)
        for family, (own, rows, chunks) in families.items():
            layout = StagingLayout(own + self.attention.graph_fields(rows, chunks), self.device)
            self.layouts[family] = layout
            self.dev[family] = self.attention.graph_views(layout.dev, rows, chunks)
            self.host[family] = [self.attention.graph_views(h, rows, chunks) for h in layout.host]
            for views in (layout.dev, *layout.stages):
                views["i64"][2] = -1  # padding rows write no slot

    def forward(self, key: GraphKey) -> Final:
        """The step graph `key` holds, on its static inputs: the model's (hidden, residual) of every row."""
        dev = self.dev["mixed" if key.chunks else "decode"]
        meta = self.attention.graph_metadata(dev, dev["i64"][2], key.tokens, self.rows_of(key), key.chunks,
                                             key.shared)
        return self.model(dev["i64"][0, : key.tokens], dev["i64"][1, : key.tokens], meta)

    def _step(self, key: GraphKey, with_logits: bool) -> tuple[Final, torch.Tensor | None]:
        final = self.forward(key)
        return final, self.model.compute_logits(*final) if with_logits else None

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture_all(self, sampler_graphs: SamplerGraphs | None) -> None:
        """Capture every start-up graph (keys()); `sampler_graphs` (rank 0): sample the LM-head graphs' logits."""
        self.make_inputs()
        self.sampler_graphs = sampler_graphs
        for key in self.keys():
            self.capture(key)
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture(self, key: GraphKey) -> Graph:
        """Capture `key` into the pool every graph shares. Mid-run (a shared variant's first step) this runs before
        the step's inputs are uploaded: the static inputs are first set to read and write no KV (the step before,
        whose inputs they still hold, is already queued)."""
        dev = self.dev["mixed" if key.chunks else "decode"]
        dev["i64"][2].fill_(-1)
        self.attention.reset_graph_inputs(dev)
        with_logits = (self.sampler_graphs is not None and not key.chunks and not key.shared
                       and key.tokens <= self.logits_max_rows)
        self._step(key, with_logits)  # eager first: Triton compiles (unless compiled ahead) outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            outputs, logits = self._step(key, with_logits)
        if self.pool is None:
            self.pool = graph.pool()
        if logits is not None:
            assert self.sampler_graphs is not None
            self.sampler_graphs.capture(logits, self.pool)
        self.graphs[key] = Graph(graph, outputs, logits)
        return self.graphs[key]

    def release(self) -> None:
        if self.graphs:
            torch.cuda.synchronize(self.device)
            self.graphs.clear()
            self.sampler_graphs = None
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ replay
    def replay(self, step: StepInput, key: GraphKey, feed_back: Callable[[torch.Tensor], None]) -> Replayed:
        """Stage `step` into graph `key`'s inputs (key_for), upload them, let `feed_back` write the tokens the step
        in flight samples into the device input ids, and replay."""
        family = "mixed" if key.chunks else "decode"
        layout, dev = self.layouts[family], self.dev[family]
        stage = layout.next_stage()
        host = self.host[family][stage]
        num_tokens, num_seqs, width = len(step.input_ids), len(step.seq_lens), max(len(b) for b in step.block_tables)
        if width > self.attention.max_blocks:
            raise RuntimeError("sequence longer than max_model_len reached a CUDA graph")
        ints = host["i64"]  # [3, tokens]: input ids, positions, slots
        ints[0, :num_tokens] = step.input_ids
        ints[1, :num_tokens] = step.positions
        ints[2, :num_tokens] = step.slot_mapping
        ints[:2, num_tokens : key.tokens] = 0
        ints[2, num_tokens : key.tokens] = -1
        rows = num_seqs if not key.chunks else step.num_decode_rows
        if key.chunks:
            host["last"][:num_seqs] = np.asarray(step.query_start_loc[1:], dtype=np.int64) - 1
        if self.attention.stage(host, step.seq_lens, step.query_start_loc, step.block_tables, num_tokens, rows,
                                self.rows_of(key), key.chunks):
            key = key._replace(shared=True)
        graph = self.graphs.get(key) or self.capture(key)
        end = layout.end_of("tables", rows)
        if not key.chunks and end <= self.single_upload_bytes:  # one copy: a latency, not bandwidth, for a few rows
            layout.upload_prefix(stage, end)
        else:  # only the rows and table columns in use
            every = slice(None)
            parts = [("i64", (every, slice(0, key.tokens))), ("attn_i32", (every,)),
                     ("tables", (slice(0, rows), slice(0, width)))]
            if key.chunks:
                parts += [("last", (slice(0, num_seqs),)), ("pre_tables", (slice(0, num_seqs - rows), slice(0, width)))]
            layout.upload(stage, [(name, index) for name, index in parts if index[0].stop != 0])
        feed_back(dev["i64"][0])
        graph.graph.replay()
        self.replays[family] += 1
        hidden, residual = graph.outputs
        if key.chunks:
            last = dev["last"][:num_seqs]
            final = (hidden.index_select(0, last), None if residual is None else residual.index_select(0, last))
        else:
            final = (hidden[:num_seqs], None if residual is None else residual[:num_seqs])
        logits = graph.logits[:num_seqs] if graph.logits is not None else None
        return Replayed(key, final, graph.outputs, logits)
