"""Runs the model for one scheduled batch: inputs, KV cache, attention metadata, CUDA graphs, sampling.

One ModelRunner per tensor-parallel rank. Rank 0 builds a `StepInput` (plain lists) from the
scheduler's batch; every rank turns it into tensors and runs the forward; rank 0 samples.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from nvcli.config import ConfigError, EngineConfig
from nvcli.engine import sampler_graphs
from nvcli.engine.attention_metadata import AttentionMetadata, DecodeSplit
from nvcli.engine.penalties import PenaltyBatch, PenaltySlots, apply_penalties
from nvcli.engine.sampler import (
    RowValues,
    SamplingBatch,
    TokenLogprobs,
    logprob_rows,
    sample,
    sampled_token_logprobs,
    token_logprobs,
)
from nvcli.engine.sampler_graphs import SamplerGraphs
from nvcli.engine.scheduler import PENDING, ScheduledBatch
from nvcli.engine.sequence import BlockTable
from nvcli.engine.uploads import upload
from nvcli.kernels.kv_layout import allocate_kv_cache
from nvcli.models.layers.attention import Attention
from nvcli.models.loader import iter_safetensors, load_dummy_weights, load_weights
from nvcli.models.registry import model_class
from nvcli.outputs import FlatLogprobs
from nvcli.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from nvcli.engine.sequence import Sequence
    from nvcli.kernels.compile_ahead import CompileWorkers, StartupMarker
    from nvcli.models.model_config import ModelConfig

log = logging.getLogger("nvcli")

# A decode step whose graph inputs (tables included) fit in this many bytes uploads them in one H2D copy.
SINGLE_UPLOAD_BYTES = 64 << 10
# Decode graphs hand attention the step's sequences longest first (AttentionMetadata.decode_order);
# NV_DECODE_LONGEST_FIRST=0 keeps batch order (A/B runs).
LONGEST_FIRST = os.environ.get("NV_DECODE_LONGEST_FIRST", "1") != "0"
# Start-up compiles its Triton kernels side by side first (kernels/compile_ahead.py), in worker processes;
# NV_COMPILE_AHEAD=threads compiles on threads of this process instead, 0 turns it off (A/B runs).
COMPILE_AHEAD = os.environ.get("NV_COMPILE_AHEAD", "processes")
# Steps that carry prompt chunks run their one-token rows through the decode kernel (AttentionMetadata.split) and,
# up to the largest of mixed_graph_sizes tokens, replay a CUDA graph: launched eagerly such a step cost the host
# ~27 ms against ~8 ms of GPU work (RESULTS session 23). NV_SPLIT_MIXED=0 / NV_MIXED_GRAPHS=0 turn either off.
SPLIT_MIXED = os.environ.get("NV_SPLIT_MIXED", "1") != "0"
MIXED_GRAPHS = os.environ.get("NV_MIXED_GRAPHS", "1") != "0"
# A mixed graph's prefill-attention grid is sized for its prompt-chunk capacity (half its tokens): a 768-token graph
# launched ~3,100 programs per layer for the one or two real chunks of a long job's typical step: 39 us per layer
# for a 562-token prompt, 21 with 8 chunk slots (RESULTS session 38). Graphs of up to MIXED_FEW_MAX_TOKENS tokens get
# a second capture for steps of at most MIXED_FEW_CHUNKS chunks. NV_MIXED_FEW_CHUNKS=0 turns it off (A/B runs).
MIXED_FEW_CHUNKS = int(os.environ.get("NV_MIXED_FEW_CHUNKS", "8"))
MIXED_FEW_MAX_TOKENS = 2048
# Decode steps whose sequences all begin with the same cached pages (one instruction in front of every line of a job)
# replay a second set of decode graphs, captured the first time a batch size needs one, whose attention reads those
# pages once per 16 query rows (kernels/shared_prefix_attention.py). It pays where the shared pages are at least half
# of the step's KV; below SHARED_PREFIX_MIN_ROWS rows the ordinary kernel's splits fill the GPU better. Mixed graphs
# (prompt chunks beside one-token rows: a long job's steady state, where new lines join most steps) get the same
# second capture for their one-token rows. NV_SHARED_PREFIX=0 turns it off (A/B runs).
SHARED_PREFIX = os.environ.get("NV_SHARED_PREFIX", "1") != "0"
SHARED_PREFIX_MIN_ROWS = 32  # 17 measured no faster (RESULTS session 41); must stay above sampler_graphs.MAX_ROWS,
# whose decode graphs end with the LM head and have no shared-prefix variant
SHARED_PREFIX_MIN_TOKENS = 256
# prompt_logprobs: the LM head runs over at most this many bytes of logits (in the model's dtype) at a time
PROMPT_LOGITS_CHUNK_BYTES = 256 << 20
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# Token-level columns of a step: lists for decode steps (one token per sequence, where Python lists are
# cheapest), numpy int64 arrays for steps that carry prompt chunks (16k tokens: per-token Python costs ms).
Ints = list[int] | np.ndarray
# The final norm's inputs of some rows: (hidden, residual) [rows, hidden] each; residual None under the deferred norm
Final = tuple[torch.Tensor, torch.Tensor | None]
# structured outputs: called between a step's forward and its sampling -> (rows, their token bitmask) or None
TokenMaskHook = Callable[[], "tuple[list[int], torch.Tensor] | None"]


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
    return StepInput(input_ids, positions, slots, qsl, seq_lens, [s.block_table for s in batch.seqs], False, pending, d,
                     logit_rows)


@dataclass
class StepHandle:
    """A launched step: sampled tokens on the device, copied to pinned host memory (with the logprobs asked for)
    behind an event."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # [num_seqs] int64 on the device
    tokens_host: torch.Tensor  # [num_seqs] int64, pinned (or the CPU tensor itself)
    done: torch.cuda.Event | None
    row_of: dict[int, int]  # seq_id -> row, for the next step's pending inputs
    logprob_rows: list[int]  # the rows that asked for logprobs
    logprob_ks: list[int]  # each one's alternatives
    logprobs: TokenLogprobs | None = None  # of logprob_rows, in order; on the host once `done`
    prompt_logprobs: TokenLogprobs | None = None  # of the batch's prompt_logit_spans, in order; on the host once `done`


@dataclass
class StepResult:
    """What a collected step hands the engine."""

    tokens: list[int]  # per batch row
    logprobs: FlatLogprobs | None  # of the rows that asked (logprob_rows), one position each
    logprob_rows: list[int]
    prompt_logprobs: FlatLogprobs | None  # the rows of the batch's prompt_logit_spans, one after another


def shared_prefix_plan(tables: np.ndarray, lens: np.ndarray, block_size: int, seqs: int
                       ) -> tuple[np.ndarray, np.ndarray] | None:
    """How the shared-prefix kernel should read a decode step's rows, or None where sharing saves too little.

    tables [>= rows, width], lens [rows] (each > 0): the step's. The rows go to the kernel in groups of `seqs`
    (kernels/shared_prefix_attention.seqs_per_group), and each group reads the pages all its tables begin with once.
    Returns (order [rows]: rows that begin with the same pages adjacent; shared [groups]: each group's shared
    tokens, whole pages that leave every row of the group its last token, 0 below SHARED_PREFIX_MIN_TOKENS). None
    below SHARED_PREFIX_MIN_ROWS rows, or where the shared pages hold less than half of the step's KV.

    Prefix caching hashes a block with everything before it, so rows that hold the same block at some page hold the
    same blocks before it. Sorting by the blocks at pages 0, 1, 3, 7, 15, ... (then longest first) therefore brings
    together the rows of each instruction, even where instructions begin alike (a chat template's header) and part
    later, at the cost of a few sort keys instead of every page."""
    rows = len(lens)
    if rows < SHARED_PREFIX_MIN_ROWS:
        return None
    depth = min(int((lens.max() - 1) // block_size), tables.shape[1])
    probes = [p for p in (0, 1, 3, 7, 15, 31, 63, 127, 255) if p < depth] or [0]
    order = np.lexsort((-lens, *(tables[:rows, p] for p in reversed(probes))))
    groups = -(-rows // seqs)
    idx = np.concatenate([order, np.full(groups * seqs - rows, order[-1])])  # the last group padded with its last row
    limit = (lens[idx].reshape(groups, seqs).min(axis=1) - 1) // block_size  # [groups] pages whole in every row
    width = min(int(limit.max()), tables.shape[1])
    if width * block_size < SHARED_PREFIX_MIN_TOKENS:
        return None
    t = tables[idx, :width].reshape(groups, seqs, width)
    same = (t == t[:, :1, :]).all(axis=1) & (np.arange(width) < limit[:, None])  # [groups, width]
    pages = np.where(same.all(axis=1), width, same.argmin(axis=1))  # leading pages every row of the group shares
    shared = (pages * block_size).astype(np.int32)
    shared[shared < SHARED_PREFIX_MIN_TOKENS] = 0
    real_rows = np.minimum(seqs, rows - np.arange(groups) * seqs)
    if 2 * int((shared.astype(np.int64) * real_rows).sum()) < int(lens.sum()):
        return None
    return order.astype(np.int32), shared


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph; a step replays the smallest one that fits."""
    top = min(max_num_seqs, 512)
    sizes = [1, 2, 4, 8] + list(range(16, top + 1, 16))
    return sorted({s for s in sizes if s <= top} | {top})


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of steps with prompt chunks that get a CUDA graph; a step replays the smallest one that fits
    (its padding rows cost GEMM rows: at most a quarter more). Eagerly the host takes 20-30 ms to launch such a
    step at any size, which only steps of more than ~8,192 tokens keep the GPU busy for (RESULTS session 23)."""
    sizes = ([64, 128] + list(range(256, 1025, 128)) + list(range(1280, 2049, 256)) + list(range(2560, 4097, 512))
             + list(range(5120, 8193, 1024)))
    return [s for s in sizes if s <= max_num_batched_tokens]


def pick_dtype(config: EngineConfig, device: str) -> torch.dtype:
    if config.dtype != "auto":
        dtype = TORCH_DTYPES[config.dtype]
    elif device == "cpu":
        dtype = torch.float32
    else:
        dtype = torch.bfloat16
    if device == "cpu" and dtype != torch.float32:
        log.warning("dtype %s on CPU is slow; float32 is the CPU default", dtype)
    return dtype


# The compile-ahead dry pass runs this many decoder layers: every later one launches the kernel variants the second
# one does (the same module at the same shapes; the first differs, with no residual stream yet), so the pass records
# the same variants in a fraction of its Python (28 layers: 3.2-5.7 s on the H100 host, RESULTS session 25).
DRY_PASS_LAYERS = 2


@contextmanager
def first_decoder_layers(model: torch.nn.Module, n: int) -> Iterator[None]:
    """Within: `model` runs only its first `n` decoder layers (`model.model.layers`; a model without that list, or
    with no more than n, runs whole)."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) <= n:
        yield
        return
    decoder.layers = torch.nn.ModuleList(list(layers)[:n])
    try:
        yield
    finally:
        decoder.layers = layers


def startup_marker(config: EngineConfig, model_config: ModelConfig, rank: int, device: torch.device) -> StartupMarker:
    """A start-up's compile-ahead marker: keyed by what shapes its launches (where the model lives, its tokenizer
    and the seed shape none)."""
    from nvcli.kernels.compile_ahead import StartupMarker

    skip = ("model", "tokenizer", "seed")
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in skip}
    shapes = model_config.to_dict()
    major, minor = torch.cuda.get_device_capability(device)
    return StartupMarker([settings, shapes, rank], f"{torch.cuda.get_device_name(device)} sm_{major}{minor}")


def start_compile_workers_if_cold(config: EngineConfig, model_config: ModelConfig, rank: int = 0) -> CompileWorkers | None:
    """The compile workers of a start-up that will compile ahead (on a GPU, NV_COMPILE_AHEAD not off or threads, and
    no earlier start-up of the same key left its marker), started now; else None. Each worker warms up for the GPU
    as it starts (compile_ahead._warm_worker). The engine calls this before loading the tokenizer, so that the
    workers' imports and warm-up (3-5 s on the H100 host) overlap it instead of the dry pass."""
    if config.resolved_device() != "cuda" or COMPILE_AHEAD in ("0", "threads"):
        return None
    device = torch.device("cuda", rank)
    if startup_marker(config, model_config, rank, device).exists():
        return None
    return _start_compile_workers(config, device)


def _start_compile_workers(config: EngineConfig, device: torch.device) -> CompileWorkers | None:
    """Compile workers for `device`'s start-up, started now (None with NV_COMPILE_AHEAD=threads, or where this
    process may have no children); the caller has checked that the start-up compiles ahead."""
    if COMPILE_AHEAD == "threads":
        return None
    from triton.runtime.driver import driver

    from nvcli.kernels.compile_ahead import start_compile_workers

    torch.cuda.set_device(device)
    target = driver.active.get_current_target()
    # NV_COMPILE_WORKERS (A/B runs) sets the count; else one per core this rank's share of the cores holds, at most 16
    num_workers = int(os.environ.get("NV_COMPILE_WORKERS", "0")) or min(16, (os.cpu_count() or 1)
                                                                        // config.tensor_parallel_size)
    return start_compile_workers(max(1, num_workers),
                                 (target.backend, target.arch, target.warp_size))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path, rank: int = 0,
                 compile_workers: CompileWorkers | None = None) -> None:
        """`compile_workers`: started by the caller for this start-up (start_compile_workers_if_cold); else the
        runner starts them itself if it compiles ahead."""
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.device = torch.device("cpu") if config.resolved_device() == "cpu" else torch.device("cuda", rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = pick_dtype(config, self.device.type)
        self.block_size = config.kvcache_block_size
        self.graph_batch_sizes = graph_batch_sizes(config.max_num_seqs)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.noise_rng = random.Random(config.seed)  # per-step noise seeds of unseeded rows (GPU sampler)
        self.prev_tokens = torch.zeros(0, dtype=torch.int64)  # the last step's sampled tokens (device)
        # token history of the sequences that sample with penalties (rank 0 samples; allocated at the first one)
        self.penalty_slots = PenaltySlots(self.device)
        self._mask_stream: torch.cuda.Stream | None = None  # structured outputs: token masks upload on it
        # Pipelined tensor parallelism: workers need rank 0's tokens to fill pending inputs.
        self.broadcast_tokens = bool(config.async_scheduling) and config.tensor_parallel_size > 1
        # prompt_logprobs: the LM head's rows per chunk (a multiple of 16), at most PROMPT_LOGITS_CHUNK_BYTES of logits
        # (on the CPU the torch form makes float32 temporaries of a chunk's size too)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.logit_chunk_rows = max(16, PROMPT_LOGITS_CHUNK_BYTES // (elem * model_config.vocab_size) // 16 * 16)

        # Wall seconds of each start-up phase (logged, and read by benchmarks/startup.py).
        self.startup_s: dict[str, float] = {}
        t0 = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal t0
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.startup_s[name] = now - t0
            t0 = now

        # A start-up like an earlier one (its marker exists) finds every Triton variant in the disk cache;
        # otherwise the compile workers start now (unless the caller started them earlier), so their imports
        # overlap the weights' load.
        marker = (startup_marker(config, model_config, rank, self.device)
                  if self.device.type == "cuda" and COMPILE_AHEAD != "0" else None)
        if marker is not None and marker.exists():
            marker = None
        workers = compile_workers
        if marker is not None and workers is None:
            workers = _start_compile_workers(config, self.device)
        elif marker is None and workers is not None:
            workers.shutdown()
            workers = None

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(model_config)(model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            load_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, iter_safetensors(model_dir))
        self.model.fold_norm_weights()  # deferred RMSNorm (models/llama.py)
        self.model.set_batch_invariant(config.batch_invariant)
        self.model.eval()
        phase("weights")
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        from nvcli.kernels.shared_prefix_attention import seqs_per_group  # triton: imported on demand

        self.shared_seqs = seqs_per_group(self.attn_layers[0].num_heads, self.attn_layers[0].num_kv_heads)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # decode graphs whose attention reads a shared prefix once per group of rows, by batch size (captured when
        # first needed), their outputs, and the memory pool every graph shares
        self.shared_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.shared_outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.graph_pool = None
        self.shared_prefix_ok = False  # set once the cache exists
        # mixed graphs by (tokens, prompt-chunk capacity): _mixed_graph_keys
        self.mixed_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # mixed graphs whose one-token rows read a shared prefix once per group of rows (captured when first needed)
        self.shared_mixed_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.shared_mixed_outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        # decode graphs of up to sampler_graphs.MAX_ROWS rows end with the LM head, and rank 0 samples their logits in
        # graphs too (engine/sampler_graphs.py); not under tensor parallelism, whose LM head gathers across ranks
        self.graph_logits: dict[int, torch.Tensor] = {}  # [rows, vocab] per graph size, rewritten by every replay
        self.sampler_graphs: SamplerGraphs | None = None
        self.logits_graph_max_rows = (sampler_graphs.MAX_ROWS if self.device.type == "cuda" and not config.enforce_eager
                                      and config.tensor_parallel_size == 1 else 0)
        self.num_mixed_replays = 0
        self.split_mixed = (self.device.type == "cuda" and SPLIT_MIXED
                            and os.environ.get("NV_ATTENTION_BACKEND", "triton") == "triton")
        self.mixed_graph_sizes = (mixed_graph_sizes(config.max_num_batched_tokens)
                                  if self.split_mixed and MIXED_GRAPHS and not config.enforce_eager else [])
        if marker is not None:
            try:
                num_variants, dry_s = self._compile_ahead(workers)
            finally:
                if workers is not None:
                    workers.shutdown()
            phase("compile_ahead")
            log.info("rank %d compiled %d Triton kernel variants ahead of start-up in %.1f s (dry pass %.1f s, %s)",
                     rank, num_variants, self.startup_s["compile_ahead"], dry_s,
                     f"{workers.num_workers} processes" if workers is not None else "threads")
        self.num_kvcache_blocks = self._allocate_kv_cache()
        phase("kv_cache")
        from nvcli.kernels.shared_prefix_attention import supports_shared_prefix  # triton: imported on demand

        self.shared_prefix_ok = (bool(self._shared_prefix_graph_sizes())
                                 and supports_shared_prefix(self.attn_layers[0].k_cache, self.attn_layers[0].v_cache))
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_cuda_graphs()
            phase("cuda_graphs")
        if self.device.type == "cuda":
            self._warm_up_kernels()
            self._recache_prefill_activations()
            phase("kernel_warm_up")
        if marker is not None:
            marker.write(num_variants)
        log.info("rank %d start-up: %s", rank, ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items()))

    # ------------------------------------------------------------------ KV cache
    def kv_bytes_per_block(self) -> int:
        layer = self.attn_layers[0]
        elem = torch.tensor([], dtype=self.kv_dtype()).element_size()
        return 2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads * layer.head_dim * elem

    def kv_dtype(self) -> torch.dtype:
        name = self.config.kv_cache_dtype
        if name.startswith("fp8"):
            return torch.float8_e4m3fn
        return TORCH_DTYPES.get(name, self.dtype)  # "auto": the model's dtype

    def _allocate_kv_cache(self) -> int:
        per_block = self.kv_bytes_per_block()
        if self.config.num_kvcache_blocks is not None:
            num_blocks = self.config.num_kvcache_blocks
        elif self.device.type == "cpu":
            max_len = self.config.max_model_len or self.model_config.max_position_embeddings
            wanted = -(-max_len // self.block_size) * self.config.max_num_seqs
            num_blocks = max(1, min(wanted, int(self.config.cpu_kvcache_space_gib * 2**30) // per_block))
        else:
            num_blocks = self._blocks_from_free_memory(per_block)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            agreed = torch.tensor([num_blocks], device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)  # every rank the same size
            num_blocks = int(agreed.item())
        layer = self.attn_layers[0]
        try:
            # [2, num_layers, num_blocks, page elements]; each layer's K and V are page views of it (kv_layout.py)
            self.kv_cache, caches = allocate_kv_cache(len(self.attn_layers), num_blocks, self.block_size,
                                                      layer.num_kv_heads, layer.head_dim, self.kv_dtype(), self.device)
        except torch.OutOfMemoryError as e:
            raise ConfigError(
                f"--num-kvcache-blocks / --gpu-memory-utilization: {num_blocks} KV blocks "
                f"({num_blocks * per_block / 2**30:.1f} GiB) do not fit in device memory"
            ) from e
        for attn, (k_cache, v_cache) in zip(self.attn_layers, caches):
            attn.k_cache, attn.v_cache = k_cache, v_cache
            attn.k_scale.fill_(self.config.kv_cache_scale)  # in place: graphs captured later read these
            attn.v_scale.fill_(self.config.kv_cache_scale)
        return num_blocks

    def _blocks_from_free_memory(self, per_block: int) -> int:
        """Measure the peak of a worst-case step, then give the KV cache what utilization allows."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._profile_run(worst_case=True)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        peak = torch.cuda.max_memory_allocated()
        current = torch.cuda.memory_allocated()
        # Activations of the worst step come back on every step; the graph pool holds about one
        # decode step's worth (graphs of all sizes share it).
        graph_pool = 0 if self.config.enforce_eager else self._graph_activation_bytes()
        budget = total * self.config.gpu_memory_utilization - used - (peak - current) - graph_pool
        num_blocks = int(budget) // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"--gpu-memory-utilization={self.config.gpu_memory_utilization}: no memory left for the KV cache "
                f"(device {total / 2**30:.1f} GiB, in use {used / 2**30:.1f} GiB, step peak "
                f"{(peak - current) / 2**30:.1f} GiB); raise it or lower --max-num-batched-tokens"
            )
        return num_blocks

    def _graph_activation_bytes(self) -> int:
        """Activation bytes of the largest CUDA graph (decode or mixed): the graphs' shared pool holds about that."""
        bs = max([self.graph_batch_sizes[-1], *self.mixed_graph_sizes])
        hidden = self.model_config.hidden_size
        inter = self.model_config.intermediate_size // max(1, self.model.tp_size)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        # the logits of the graphs that end with the LM head stay allocated beside it, one tensor per graph size
        logit_rows = sum(s for s in self.graph_batch_sizes if s <= self.logits_graph_max_rows)
        return bs * (6 * hidden + 3 * inter) * elem + logit_rows * self.model_config.vocab_size * elem + (64 << 20)

    def _largest_prefill(self) -> tuple[StepInput, int]:
        """The largest prompt step a job can schedule (max_num_batched_tokens tokens, in sequences of at most
        max_model_len) and the cache blocks each of its sequences reads. It writes nothing (slot -1)."""
        n = min(self.config.max_num_batched_tokens, (self.config.max_model_len or 4096) * self.config.max_num_seqs)
        seq_len = min(n, self.config.max_model_len or n)
        num_seqs = -(-n // seq_len)
        blocks = -(-seq_len // self.block_size)
        qsl = [min(i * seq_len, n) for i in range(num_seqs + 1)]
        step = StepInput([0] * n, [i % seq_len for i in range(n)], [-1] * n, qsl,
                         [qsl[i + 1] - qsl[i] for i in range(num_seqs)], [list(range(blocks))] * num_seqs, False)
        return step, blocks

    @torch.inference_mode()
    def _run_largest_prefill(self, step: StepInput, worst_case: bool = False) -> None:
        """`worst_case` (the KV-sizing profile run): rank 0 holds the penalty pool at the size that max_num_seqs
        penalized sequences grow it to and samples the logits with every feature on every row; then, with those
        logits still alive as in a step, every rank runs a scoring chunk (prompt_logprobs) of the step's rows."""
        pool = self._largest_penalty_pool() if worst_case and self.rank == 0 else None
        hidden, residual = self._forward(step)
        rows = slice(0, self.config.max_num_seqs)
        logits = self.model.compute_logits(hidden[rows], residual[rows] if residual is not None else None)
        if pool is not None:
            self._sample_worst_case(logits, counts=pool[0], seen=pool[1])
        if worst_case:
            self._score_worst_case(hidden, residual)
        del hidden, residual, logits, pool

    def _score_worst_case(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """A step's scoring work at its largest: the prompt rows gathered (a copy, as `_logit_rows` makes), their
        logits a chunk of PROMPT_LOGITS_CHUNK_BYTES, and rank 0's reduction of it to logprobs, ranks and the most
        alternatives. A scoring job with few sequences (little to sample) would otherwise meet a chunk of 256 MB that
        KV sizing never saw. Every rank computes the chunk (the LM head gathers the vocab across ranks)."""
        n = self.logit_chunk_rows  # a step pads its prompt rows to whole chunks (_logit_rows)
        index = torch.arange(n, device=self.device) % hidden.shape[0]
        extra = (hidden[index], None if residual is None else residual[index])
        chunks = self._prompt_logit_chunks(extra)
        if self.rank == 0:
            token_logprobs(chunks, torch.zeros(n, dtype=torch.int64, device=self.device), MAX_LOGPROBS, self.device)
        else:
            for _ in chunks:
                pass

    def _largest_penalty_pool(self) -> list[torch.Tensor]:
        """PenaltySlots' history tensors (counts int32, seen bool: [slots, vocab]) at the size max_num_seqs held
        sequences grow them to, then the half-size pair the last doubling copied them from, which the step that grows
        the pool holds as well."""
        slots = self.penalty_slots.slots_for(self.config.max_num_seqs)
        vocab = self.model_config.vocab_size
        return [torch.zeros((n, vocab), dtype=dtype, device=self.device)
                for n in (slots, slots // 2) for dtype in (torch.int32, torch.bool)]

    def _sample_worst_case(self, logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> None:
        """Sample `logits` [rows, vocab] as a step whose every row asks for every sampling feature: logit_bias and
        the penalties (each a float32 copy of the logits), top-k / top-p / min-p (the floor kernel's scratch) and
        the most logprobs. The profile run's peak then covers what a job's sampler allocates beside its logits;
        without it a job at a --gpu-memory-utilization near 1 could run out of memory at its first penalized step."""
        rows, vocab = logits.shape
        index = torch.arange(rows, device=self.device)
        ones = torch.ones(rows, dtype=torch.float32, device=self.device)
        penalties = PenaltyBatch(rows=index, slots=index, presence=ones, frequency=ones, repetition=ones * 1.1,
                                 counts=counts, seen=seen)
        params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05, logit_bias={0: 1.0},
                                 logprobs=MAX_LOGPROBS)] * rows
        batch = SamplingBatch.build(params, [0] * rows, vocab, self.device, random.Random(0), penalties=penalties)
        tokens = sample(logits, batch, torch.Generator(device=self.device).manual_seed(0))  # the job's RNG untouched
        sampled_token_logprobs(logits, tokens, *logprob_rows(batch.num_logprobs))

    @torch.inference_mode()
    def _profile_run(self, worst_case: bool = False) -> None:
        step, blocks = self._largest_prefill()
        layer = self.attn_layers[0]
        # Attention must read real blocks; every sequence and layer shares one scratch cache (in the real
        # cache's page layouts, so the kernel variants are the job's).
        _, ((dummy_k, dummy_v),) = allocate_kv_cache(1, blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                                                      self.kv_dtype(), self.device)
        for attn in self.attn_layers:
            attn.k_cache, attn.v_cache = dummy_k, dummy_v
        self._run_largest_prefill(step, worst_case)

    def _recache_prefill_activations(self) -> None:
        """Put a largest prompt step's activations back into PyTorch's caching allocator.

        Every CUDA-graph capture empties that cache (torch.cuda.graph does), so the profile run's blocks are gone
        by the time a job starts, and its first long prompt steps would cudaMalloc their activations mid-run
        (the benchmark's first run on the H100 grew 4-7 segments of 32-192 MiB; benchmarks/RESULTS.md, session
        15). Near the memory limit a cudaMalloc that fails makes the allocator free its cache and synchronize
        the device. The KV cache was sized to leave this peak free. The step reads the first blocks of the real
        cache and writes none."""
        step, blocks = self._largest_prefill()
        if blocks <= self.num_kvcache_blocks:
            self._run_largest_prefill(step)

    def _max_table_width(self) -> int:
        """Blocks in the block table of a sequence of max_model_len tokens."""
        return -(-(self.config.max_model_len or self.model_config.max_position_embeddings) // self.block_size)

    @torch.inference_mode()
    def _warm_up_kernels(self, dry_run: bool = False) -> None:
        """Compile, at start-up, the Triton variants a job would otherwise compile mid-run.

        Triton specializes integer arguments (== 1, multiples of 16) and our kernels pick configs by
        row count, so the first prefill of an odd length, or the LM head and sampler at 1, 2 or a few
        rows once a job's batch drains, each cost a compile (up to a second) in the middle of the
        job. Every step here writes nothing to the KV cache (slot -1) and its outputs are dropped.
        `dry_run` (the compile-ahead pass, whose kernels leave outputs unwritten): no sampling, and no
        eager decode steps where decode graphs are to be captured (the real pass replays those).
        """
        cache_tokens = self.attn_layers[0].k_cache.shape[0] * self.block_size
        if cache_tokens < 32 or (self.config.max_model_len or 32) < 32:
            return  # the shapes below need 32 tokens of cache to read from
        blocks = [list(range(-(-32 // self.block_size)))]
        # As wide a table as max_model_len allows (block 0 over and over; the lengths stay short, so only the first
        # tokens are read): decode attention splits the KV as it does for long sequences, which is its other variant
        # (the FUSED_REDUCE merge). Without it a job's first long eager step compiled that variant mid-run.
        wide = [[0] * self._max_table_width()]
        # prefill: odd / multiple-of-16 token counts; eager decode; decode rows beside a prompt chunk (split
        # attention: the decode kernel at one and at 17 rows, over short and long tables) where a step too large for
        # the mixed graphs runs them
        for lens, table in (([17, 14], blocks), ([16, 32], blocks), ([1], blocks), ([1, 16], blocks), ([1, 16], wide),
                            ([1] * 17 + [14], blocks), ([1] * 17 + [14], wide)):
            qsl = [0]
            for n in lens:
                qsl.append(qsl[-1] + n)
            step = StepInput([0] * qsl[-1], [p for n in lens for p in range(n)], [-1] * qsl[-1], qsl, lens,
                             table * len(lens), False, num_decode_rows=lens.count(1) if len(lens) > 1 else 0)
            self._forward(step)
        # imported here, not with this module: the CPU tests switch Triton to its interpreter after importing the engine
        from nvcli.kernels.skinny_gemm import MAX_M as SKINNY_MAX_M

        # LM head at every row count the skinny GEMM takes (its configs and row blocks change with the count and with
        # the model's shape: a tiny model's LM head compiled a variant mid-run when only 1, 2 and 3 rows were warmed)
        # and cuBLAS past them; eager decode steps (enforce_eager) over short and long tables, as above
        skinny_rows = [(rows, blocks) for rows in range(2, SKINNY_MAX_M + 1)]
        for rows, table in [(1, wide), *skinny_rows, (SKINNY_MAX_M + 1, blocks), (SKINNY_MAX_M + 1, wide)]:
            step = StepInput([0] * rows, [0] * rows, [-1] * rows, list(range(rows + 1)), [1] * rows,
                             table * rows, True)
            if dry_run and not self.config.enforce_eager:
                hidden = torch.zeros(rows, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
                final = (hidden, hidden)
            else:
                final = self._forward(step)
            if self.rank == 0 and not dry_run:
                logits = self.model.compute_logits(*final)
                for temperature in (0.0, 0.7):  # argmax, fused sampler
                    params = [SamplingParams(temperature=temperature)] * rows
                    sample(logits, SamplingBatch.build(params, [0] * rows, logits.shape[1], self.device, random.Random(0)),
                           torch.Generator(device=self.device).manual_seed(0))  # leaves the job's RNG alone
                if rows == 1:
                    # a step with penalized rows samples from a float32 copy that the penalty kernel writes
                    # (engine/penalties.py): that kernel, and the fused sampler's float32 variant for a bf16 / fp16
                    # model, would otherwise compile at a job's first such step
                    one = torch.zeros(1, dtype=torch.int64, device=self.device)
                    history = torch.zeros((1, logits.shape[1]), dtype=torch.int32, device=self.device)
                    neutral = torch.ones(1, dtype=torch.float32, device=self.device)
                    penalized = apply_penalties(logits, PenaltyBatch(rows=one, slots=one, presence=neutral,
                                                                     frequency=neutral, repetition=neutral,
                                                                     counts=history, seen=history.bool()))
                    sample(penalized, SamplingBatch.build([SamplingParams(temperature=0.7)], [0], logits.shape[1],
                                                          self.device, random.Random(0)),
                           torch.Generator(device=self.device).manual_seed(0))
                    # top-k / top-p / min-p (a model's generation_config often sets them for every request): the
                    # floor kernel and the sampler's floored variants, on model-dtype and float32 logits
                    filtered = [SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05)]
                    for x in (logits, penalized):
                        sample(x, SamplingBatch.build(filtered, [0], logits.shape[1], self.device, random.Random(0)),
                               torch.Generator(device=self.device).manual_seed(0))
                    from nvcli.kernels.token_bitmask import apply_token_bitmask_

                    # structured outputs' mask (kernels/token_bitmask.py), on the model-dtype logits it writes in a job
                    words = -(-logits.shape[1] // 32)
                    apply_token_bitmask_(logits, one, torch.full((1, words), -1, dtype=torch.int32, device=self.device))
            else:
                logits = self.model.compute_logits(*final)
            if rows <= SKINNY_MAX_M:
                # a prompt step's few last rows under the deferred norm (no residual): the final RMSNorm alone, with
                # PDL at these row counts; a job whose first prompt step held one sequence compiled it mid-run
                self.model.compute_logits(final[0], None)
            if self.rank == 0 and rows == 1:  # logprobs and prompt_logprobs: each top-k width, in the dry pass too
                from nvcli.kernels.token_logprobs import TOP_WIDTHS

                one = torch.zeros(1, dtype=torch.int64, device=self.device)
                for k in TOP_WIDTHS:
                    token_logprobs([logits], one, min(k, logits.shape[1]), self.device)
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ forward
    def _tensors(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        def t(x: Ints, dtype: np.dtype) -> torch.Tensor:  # via numpy: torch.tensor(list) is ~3x slower
            return upload(torch.from_numpy(np.asarray(x, dtype=dtype)), self.device)

        meta = AttentionMetadata(
            slot_mapping=t(step.slot_mapping, np.int64),
            query_start_loc=t(step.query_start_loc, np.int32),
            seq_lens=t(step.seq_lens, np.int32),
            block_tables=upload(torch.from_numpy(_pad_tables(step.block_tables)), self.device),
            max_query_len=max(b - a for a, b in zip(step.query_start_loc, step.query_start_loc[1:])),
            max_seq_len=max(step.seq_lens),
            decode_only=step.decode_only,
        )
        d = step.num_decode_rows
        if d and not step.decode_only and self.split_mixed:
            lens = np.asarray(step.seq_lens, dtype=np.int32)
            qsl = step.query_start_loc
            meta.split = DecodeSplit(
                num_rows=d, seq_lens=meta.seq_lens[:d], block_tables=meta.block_tables[:d],
                order=t(np.argsort(-lens[:d], kind="stable"), np.int32), prefill_query_start_loc=meta.query_start_loc[d:],
                prefill_seq_lens=meta.seq_lens[d:], prefill_block_tables=meta.block_tables[d:],
                prefill_max_query_len=max([b - a for a, b in zip(qsl[d:], qsl[d + 1:])], default=0))
        return t(step.input_ids, np.int64), t(step.positions, np.int64), meta

    def _feed_back(self, input_ids: torch.Tensor, step: StepInput) -> None:
        """Write the previous step's sampled tokens into this step's inputs, on the device."""
        if not step.pending:
            return
        n = len(step.pending)
        if all(a == i and b == i for i, (a, b) in enumerate(step.pending)):
            # steady decode: row i continues row i of the step in flight; one device copy instead of an
            # index upload, a gather and a scatter (a token's latency pays for every launch)
            input_ids[:n].copy_(self.prev_tokens[:n])
            return
        rows = upload(torch.tensor(step.pending, dtype=torch.int64), self.device)  # [n, 2]
        input_ids[rows[:, 0]] = self.prev_tokens[rows[:, 1]]

    @torch.inference_mode()
    def _forward(self, step: StepInput) -> Final:
        """The last token of each sequence: the final norm's inputs (hidden, residual), [num_seqs, hidden] each
        (residual None where the model returns the residual stream itself: deferred norm, models/llama.py)."""
        return self._forward_rows(step)[0]

    def _forward_rows(self, step: StepInput) -> tuple[Final, Final | None]:
        """_forward's rows, and the same of `step.logit_rows` ([len(logit_rows), hidden] each; None without)."""
        bs = len(step.seq_lens)
        if step.decode_only and self.graphs and bs <= self.graph_batch_sizes[-1]:
            return self._replay_graph(step), None
        key = self._mixed_graph_for(step) if self.mixed_graphs and not step.decode_only else None
        if key is not None:
            return self._replay_mixed_graph(step, key)
        input_ids, positions, meta = self._tensors(step)
        self._feed_back(input_ids, step)
        hidden, residual = self.model(input_ids, positions, meta)  # [num_tokens, hidden] each
        if step.decode_only:  # one token per sequence: every row is a last token
            return (hidden, residual), None
        return _rows((hidden, residual), meta.query_start_loc[1:].long() - 1), self._logit_rows((hidden, residual), step)

    def _logit_rows(self, final: Final, step: StepInput) -> Final | None:
        """The final norm's inputs of step.logit_rows; on a GPU padded (the last row repeated) to whole chunks of
        `logit_chunk_rows`, so that the LM head and the reductions meet one shape, not a new one every step
        (cuBLAS pays milliseconds of host time for each row count it has not seen; RESULTS session 15)."""
        n = len(step.logit_rows)
        if not n:
            return None
        index = np.asarray(step.logit_rows, dtype=np.int64)
        if self.device.type == "cuda" and n % self.logit_chunk_rows:
            index = np.concatenate([index, np.full(self.logit_chunk_rows - n % self.logit_chunk_rows, index[-1])])
        return _rows(final, upload(torch.from_numpy(index), self.device))

    def _prompt_logit_chunks(self, rows: Final) -> Iterator[torch.Tensor]:
        """Logits [<= logit_chunk_rows, vocab] of `rows`, a bounded chunk at a time: a 16k-token prompt step's logits
        in one piece would take 5 GB in bf16. Every TP rank runs the same chunks (the LM head gathers the vocab)."""
        hidden, residual = rows
        chunk = self.logit_chunk_rows
        for a in range(0, hidden.shape[0], chunk):
            yield self.model.compute_logits(hidden[a : a + chunk], None if residual is None else residual[a : a + chunk])

    @torch.inference_mode()
    def forward_logits(self, step: StepInput) -> torch.Tensor:
        """Logits [num_seqs, vocab] (float32) of each sequence's last token; no sampling."""
        return self.model.compute_logits(*self._forward(step)).float()

    @torch.inference_mode()
    def execute(self, step: StepInput) -> None:
        """A tensor-parallel worker's share of a step (rank 0 runs `launch`)."""
        final, extra = self._forward_rows(step)
        self.model.compute_logits(*final)  # the vocab-parallel gather needs every rank
        if self.broadcast_tokens:  # rank 0's sampled tokens, for the next step's pending inputs
            self.prev_tokens = torch.empty(len(step.seq_lens), dtype=torch.int64, device=self.device)
            torch.distributed.broadcast(self.prev_tokens, src=0)
        for _ in self._prompt_logit_chunks(extra) if extra is not None else ():  # rank 0 runs them after the broadcast
            pass

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, step: StepInput, token_masks: TokenMaskHook | None = None) -> StepHandle:
        """Enqueue forward and sampling (rank 0); returns before the device is done. `token_masks` (structured
        outputs) is called once the forward is enqueued, so the host builds the masks while the device runs it:
        (rows, bitmask [len(rows), ceil(vocab / 32)] int32) that restrict those rows' tokens, or None."""
        num_seqs = len(step.seq_lens)
        graph_bs = self._logits_graph_for(step)
        if graph_bs:  # the graph ends with the LM head
            self._replay_graph(step)
            extra = None
            logits = self.graph_logits[graph_bs][:num_seqs]  # [num_seqs, vocab]
        else:
            final, extra = self._forward_rows(step)
            logits = self.model.compute_logits(*final)  # [num_seqs, vocab] in the model dtype; the sampler upcasts
        masks = token_masks() if token_masks is not None else None
        if masks is not None:  # in place: the logprobs are then those of the constrained distribution, as in vLLM
            # imported late, as token_logprobs: the CPU tests pick Triton's interpreter after importing the engine
            from nvcli.kernels.token_bitmask import apply_token_bitmask_

            rows, bitmask = masks
            apply_token_bitmask_(logits, *self._upload_token_mask(rows, bitmask))
        params = [s.sampling_params for s in batch.seqs]
        positions = [max(0, i - s.num_prompt_tokens) for s, i in zip(batch.seqs, batch.sample_index)]
        banned = [(row, s.min_tokens_banned) for row, (s, pos) in enumerate(zip(batch.seqs, positions))
                  if s.min_tokens_banned and pos < s.sampling_params.min_tokens]
        penalties = self.penalty_slots.prepare(batch.seqs, batch.sample_index, logits.shape[1])  # None: no such row
        if (graph_bs and masks is None and penalties is None and not banned
                and not any(p.logit_bias for p in params)):
            values = RowValues.of(params, positions, logits.shape[1], self.noise_rng)
            tokens = self.sampler_graphs.sample(graph_bs, values)[:num_seqs]
        else:
            sb = SamplingBatch.build(params, positions, logits.shape[1], self.device,
                                     self.noise_rng if self.device.type == "cuda" else None, banned, penalties)
            tokens = sample(logits, sb, self.generator)
        if penalties is not None:
            self.penalty_slots.record(penalties, tokens)
        self.prev_tokens = tokens
        if self.broadcast_tokens:
            torch.distributed.broadcast(tokens, src=0)
        rows, ks = logprob_rows([p.logprobs for p in params])
        logprobs = sampled_token_logprobs(logits, tokens, rows, ks)
        prompt_lp = None
        if extra is not None:
            targets, span_ks = _prompt_logprob_targets(batch)
            targets += targets[-1:] * (extra[0].shape[0] - len(targets))  # padding rows (_logit_rows)
            prompt_lp = token_logprobs(self._prompt_logit_chunks(extra), targets, max(span_ks), self.device)
        done = None
        if self.device.type == "cuda":  # one event behind every copy: collect reads them all after it
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            logprobs = None if logprobs is None else logprobs.to_host()
            prompt_lp = None if prompt_lp is None else prompt_lp.to_host()
            done = torch.cuda.Event()
            done.record()
        else:
            host = tokens
        return StepHandle(batch, tokens, host, done, {s.seq_id: i for i, s in enumerate(batch.seqs)}, rows, ks,
                          logprobs, prompt_lp)

    def _upload_token_mask(self, rows: list[int], bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows and their bitmask on the device. On a GPU the copy (19 KB a row: 4.9 MB at 256 rows) goes on a
        stream of its own, so that it overlaps the forward still running instead of waiting behind it on the
        step's stream; the mask kernel waits for it (H100: +0.5 ms per step with it in line, RESULTS session 30)."""
        rows_host = torch.tensor(rows, dtype=torch.int64)
        if self.device.type != "cuda":
            return rows_host, bitmask
        if self._mask_stream is None:
            self._mask_stream = torch.cuda.Stream(self.device)
        step_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._mask_stream):
            rows_dev, mask_dev = upload(rows_host, self.device), upload(bitmask, self.device)
        step_stream.wait_stream(self._mask_stream)
        rows_dev.record_stream(step_stream)  # allocated on the copy stream, read on the step's
        mask_dev.record_stream(step_stream)
        return rows_dev, mask_dev

    def collect(self, handle: StepHandle) -> StepResult:
        """Wait for a launched step; its tokens (and logprobs where asked)."""
        if handle.done is not None:
            handle.done.synchronize()
        tokens = handle.tokens_host.tolist()
        logprobs = None if handle.logprobs is None else handle.logprobs.flat(handle.logprob_ks)
        prompt_logprobs = None
        if handle.prompt_logprobs is not None:
            spans = handle.batch.prompt_logit_spans
            seqs = handle.batch.seqs
            prompt_logprobs = handle.prompt_logprobs.flat(np.repeat(  # each span's k on each of its rows
                [seqs[i].sampling_params.prompt_logprobs or 0 for i, _, _ in spans], [hi - lo for _, lo, hi in spans]))
        return StepResult(tokens, logprobs, handle.logprob_rows, prompt_logprobs)

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def _make_graph_inputs(self) -> None:
        """The decode graphs' static input buffers (once; the compile-ahead pass runs the same forwards).

        All of them live in one device byte buffer laid out like one pinned host staging buffer, so a
        small step uploads its inputs with a single copy (each H2D copy costs a few microseconds of
        latency on the stream, which one token's step pays in full)."""
        if hasattr(self, "g_blob"):
            return
        max_bs = self.graph_batch_sizes[-1]
        max_blocks = self._max_table_width()
        self.g_max_blocks = max_blocks
        # byte layout: int64 [3, max_bs] (input ids, positions, slots) | int32 [max_bs] seq lens |
        # int32 [max_bs] decode order | int32 [max_bs, 16-byte aligned] shared prefix tokens per group of rows
        # (shared_prefix_plan) | int32 [max_bs, max_blocks] block tables; a step of bs rows needs the bytes below
        # tables row bs
        self.g_off_lens = 3 * max_bs * 8
        self.g_off_tables = self.g_off_lens + 2 * max_bs * 4 + -(-max_bs * 4 // 16) * 16
        size = self.g_off_tables + max_bs * max_blocks * 4

        def views(blob: torch.Tensor) -> tuple[torch.Tensor, ...]:
            lens_order = blob[self.g_off_lens : self.g_off_tables].view(torch.int32)
            return (blob[: self.g_off_lens].view(torch.int64).view(3, max_bs), lens_order[:max_bs],
                    lens_order[max_bs : 2 * max_bs], blob[self.g_off_tables :].view(torch.int32).view(max_bs, max_blocks),
                    lens_order[2 * max_bs : 3 * max_bs])

        self.g_blob = torch.zeros(size, dtype=torch.uint8, device=self.device)
        self.g_i64, self.g_seq_lens, self.g_order, self.g_block_tables, self.g_shared_len = views(self.g_blob)
        self.g_i64[2] = -1
        self.g_input_ids, self.g_positions, self.g_slots = self.g_i64[0], self.g_i64[1], self.g_i64[2]
        # Pinned host staging buffers, filled through numpy views and copied without a sync. Two sets,
        # used in turn: with async scheduling step N+1 is staged while step N's copies may still be
        # queued behind step N-1 on the device; step N-1 has completed by then, so its set is free.
        self.stage_blobs = [torch.zeros(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.stages = [views(blob) for blob in self.stage_blobs]
        self.num_replays = 0
        self.g_qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)
        # each graph's outputs: (hidden, residual) [bs, hidden] in the graphs' memory pool, rewritten by
        # every replay of that graph
        self.graph_outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.mixed_outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        if self.mixed_graph_sizes:
            self._make_mixed_graph_inputs(max_blocks)

    def _make_mixed_graph_inputs(self, max_blocks: int) -> None:
        """The mixed graphs' static inputs: one device byte buffer and two pinned staging copies of it.

        Byte layout: int64 [3, T] (input ids, positions, slots) | int64 [D + P] each sequence's last row | int32 decode
        rows' lengths [D] and program order [D], prompt chunks' query starts [P + 1] and lengths [P], the decode rows'
        shared prefix tokens per group [D] | int32 decode rows' tables [D, max_blocks] | int32 prompt chunks' tables
        [P, max_blocks]; T the largest graph's tokens, D and P its decode-row and prompt-chunk capacities."""
        t_max = self.mixed_graph_sizes[-1]
        d_max, p_max = self._mixed_capacity(t_max)
        sizes = [("i64", 3 * t_max * 8), ("last", (d_max + p_max) * 8), ("i32", (3 * d_max + 2 * p_max + 1) * 4),
                 ("dec_tables", d_max * max_blocks * 4), ("pre_tables", p_max * max_blocks * 4)]
        offsets, at = {}, 0
        for name, n in sizes:
            offsets[name] = (at, at + n)
            at += n

        def views(blob: torch.Tensor) -> dict[str, torch.Tensor]:
            v = {name: blob[a:b] for name, (a, b) in offsets.items()}
            i32 = v["i32"].view(torch.int32)
            return {"i64": v["i64"].view(torch.int64).view(3, t_max), "last": v["last"].view(torch.int64),
                    "i32": v["i32"], "dec_lens": i32[:d_max], "dec_order": i32[d_max : 2 * d_max],
                    "pre_qsl": i32[2 * d_max : 2 * d_max + p_max + 1],
                    "pre_lens": i32[2 * d_max + p_max + 1 : 2 * d_max + 2 * p_max + 1],
                    "shared": i32[2 * d_max + 2 * p_max + 1 :],
                    "dec_tables": v["dec_tables"].view(torch.int32).view(d_max, max_blocks),
                    "pre_tables": v["pre_tables"].view(torch.int32).view(p_max, max_blocks)}

        self.m_blob = torch.zeros(at, dtype=torch.uint8, device=self.device)
        self.m = views(self.m_blob)
        self.m["i64"][2] = -1
        self.m_stage_blobs = [torch.zeros(at, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.m_stages = [views(blob) for blob in self.m_stage_blobs]
        for stage in self.m_stages:
            stage["i64"][2] = -1

    def _mixed_capacity(self, tokens: int) -> tuple[int, int]:
        """(decode rows, prompt chunks) a mixed graph of `tokens` rows holds at most: a prompt chunk has 2+ tokens
        (the scheduler's one-token rows are decode rows)."""
        return min(tokens, self.config.max_num_seqs), max(1, min(self.config.max_num_seqs, tokens // 2))

    def _mixed_graph_keys(self) -> list[tuple[int, int]]:
        """(tokens, prompt-chunk capacity) of every mixed graph, largest first: each size at its full capacity, and
        sizes up to MIXED_FEW_MAX_TOKENS also at MIXED_FEW_CHUNKS chunks (a smaller prefill-attention grid)."""
        keys = []
        for tokens in reversed(self.mixed_graph_sizes):
            chunks = self._mixed_capacity(tokens)[1]
            keys.append((tokens, chunks))
            if 0 < MIXED_FEW_CHUNKS < chunks and tokens <= MIXED_FEW_MAX_TOKENS:
                keys.append((tokens, MIXED_FEW_CHUNKS))
        return keys

    def _mixed_graph_forward(self, tokens: int, chunks: int, shared_prefix: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step with up to `chunks` prompt chunks that a mixed graph of `tokens` rows holds, on the static
        buffers (lengths 0, slots -1: reads and writes no KV); `shared_prefix`: its one-token rows' attention reads
        the shared tokens m["shared"] once per group of rows."""
        d, p = self._mixed_capacity(tokens)[0], chunks
        m = self.m
        split = DecodeSplit(d, m["dec_lens"][:d], m["dec_tables"][:d], m["dec_order"][:d], m["pre_qsl"][: p + 1],
                            m["pre_lens"][:p], m["pre_tables"][:p], tokens,
                            shared_prefix_len=m["shared"][: self._shared_groups(d)] if shared_prefix else None)
        meta = AttentionMetadata(m["i64"][2, :tokens], m["pre_qsl"][: p + 1], m["pre_lens"][:p], m["pre_tables"][:p],
                                 tokens, self.g_max_blocks * self.block_size, False, None, split)
        return self.model(m["i64"][0, :tokens], m["i64"][1, :tokens], meta)

    def _graph_forward(self, bs: int, shared_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode step a graph of `bs` rows holds, on the static buffers (seq_len 0, slot -1: reads and
        writes no KV); `shared_prefix`: its attention reads g_shared_len shared tokens once per group of rows."""
        meta = AttentionMetadata(self.g_slots[:bs], self.g_qsl[: bs + 1], self.g_seq_lens[:bs],
                                 self.g_block_tables[:bs], 1, self.g_max_blocks * self.block_size, True,
                                 self.g_order[:bs] if LONGEST_FIRST or shared_prefix else None,  # groups rows
                                 shared_prefix_len=self.g_shared_len[: self._shared_groups(bs)] if shared_prefix
                                 else None)
        return self.model(self.g_input_ids[:bs], self.g_positions[:bs], meta)

    def _shared_groups(self, rows: int) -> int:
        """Groups of rows the shared-prefix kernel forms from `rows` one-token rows."""
        return -(-rows // self.shared_seqs)

    def _shared_prefix_graph_sizes(self) -> list[int]:
        """The decode graph sizes that may replay a shared-prefix graph (none where the kernel cannot serve: the CPU,
        eager mode, the torch attention backend; --batch-invariant, whose attention takes every row alike)."""
        if not (SHARED_PREFIX and self.device.type == "cuda" and not self.config.enforce_eager
                and not self.config.batch_invariant and os.environ.get("NV_ATTENTION_BACKEND", "triton") == "triton"):
            return []
        return [bs for bs in self.graph_batch_sizes if bs >= SHARED_PREFIX_MIN_ROWS]

    @torch.inference_mode()
    def _shared_prefix_graph(self, bs: int) -> torch.cuda.CUDAGraph:
        """The shared-prefix decode graph of `bs` rows, captured the first time a step needs it. Called before the
        step's inputs are uploaded: the static buffers are first set to read and write no KV (the step before, whose
        inputs they still hold, is already queued), so the eager pass and the capture touch no cache."""
        if bs not in self.shared_graphs:
            self.g_slots.fill_(-1)
            self.g_seq_lens.zero_()
            self.g_shared_len.zero_()
            self.shared_graphs[bs], self.shared_outputs[bs] = self._capture_in_pool(
                lambda: self._graph_forward(bs, shared_prefix=True))
            log.info("captured the shared-prefix decode graph of %d rows", bs)
        return self.shared_graphs[bs]

    @torch.inference_mode()
    def _shared_mixed_graph(self, key: tuple[int, int]) -> torch.cuda.CUDAGraph:
        """The shared-prefix variant of the mixed graph `key`, captured the first time a step needs it; like
        _shared_prefix_graph, before the step's inputs are uploaded, on static buffers set to touch no KV."""
        if key not in self.shared_mixed_graphs:
            self.m["i64"][2].fill_(-1)
            self.m["i32"].zero_()  # lengths 0, chunks empty, no shared tokens
            self.shared_mixed_graphs[key], self.shared_mixed_outputs[key] = self._capture_in_pool(
                lambda: self._mixed_graph_forward(*key, shared_prefix=True))
            log.info("captured the shared-prefix mixed graph of %d tokens, %d prompt chunks", *key)
        return self.shared_mixed_graphs[key]

    def _capture_in_pool(self, forward: Callable[[], Final]) -> tuple[torch.cuda.CUDAGraph, Final]:
        """A graph of `forward`, captured mid-run into the pool every graph shares, and its outputs; run eagerly first,
        as at start-up: nothing may initialize inside a capture."""
        forward()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.graph_pool):
            outputs = forward()
        return graph, outputs

    def _shared_mixed_keys(self) -> list[tuple[int, int]]:
        """One mixed graph key per decode-row capacity that may take the shared-prefix kernel: the compile-ahead pass
        runs these (the kernel's variants differ by row count, not by the graph's tokens or chunks)."""
        if not self._shared_prefix_graph_sizes():
            return []
        by_rows = {self._mixed_capacity(key[0])[0]: key for key in self._mixed_graph_keys()}
        return [key for rows, key in by_rows.items() if rows >= SHARED_PREFIX_MIN_ROWS]

    def _graph_step(self, bs: int, with_logits: bool) -> tuple[Final, torch.Tensor | None]:
        """_graph_forward's outputs, and where `with_logits` their logits [bs, vocab] (else None)."""
        final = self._graph_forward(bs)
        return final, self.model.compute_logits(*final) if with_logits else None

    @torch.inference_mode()
    def _capture_cuda_graphs(self) -> None:
        self._make_graph_inputs()
        pool = None
        if self.logits_graph_max_rows and self.rank == 0:
            self.sampler_graphs = SamplerGraphs(self.logits_graph_max_rows, self.model_config.vocab_size, self.device)
        for bs in reversed(self.graph_batch_sizes):
            with_logits = self.sampler_graphs is not None and bs <= self.logits_graph_max_rows
            self._graph_step(bs, with_logits)  # eager first: Triton compiles (unless compiled ahead) outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.graph_outputs[bs], logits = self._graph_step(bs, with_logits)
            if pool is None:
                pool = graph.pool()
                self.graph_pool = pool
            self.graphs[bs] = graph
            if logits is not None:
                self.graph_logits[bs] = logits
                self.sampler_graphs.capture(logits, pool)
            torch.cuda.synchronize()
        for key in self._mixed_graph_keys():
            self._mixed_graph_forward(*key)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.mixed_outputs[key] = self._mixed_graph_forward(*key)
            self.mixed_graphs[key] = graph
            torch.cuda.synchronize()

    @torch.inference_mode()
    def _compile_ahead(self, workers: CompileWorkers | None) -> tuple[int, float]:
        """Compile, in parallel, every Triton variant the start-up's forwards below will launch (see
        kernels/compile_ahead.py): the profile run, a decode step at each graph size, the warm-up shapes."""
        from nvcli.kernels.compile_ahead import compile_ahead

        def forwards() -> None:
            self._profile_run()  # leaves its scratch cache on the layers: the steps below read block 0 of it
            if not self.config.enforce_eager:
                self._make_graph_inputs()
                for bs in reversed(self.graph_batch_sizes):
                    self._graph_forward(bs)
                for bs in self._shared_prefix_graph_sizes():  # captured when a job first needs one: compiled now
                    self._graph_forward(bs, shared_prefix=True)
                for key in self._mixed_graph_keys():
                    self._mixed_graph_forward(*key)
                for key in self._shared_mixed_keys():
                    self._mixed_graph_forward(*key, shared_prefix=True)
            self._warm_up_kernels(dry_run=True)

        with first_decoder_layers(self.model, DRY_PASS_LAYERS):
            result = compile_ahead(forwards, self.device, workers=workers)
        for attn in self.attn_layers:
            attn.k_cache = attn.v_cache = None
        torch.cuda.empty_cache()
        return result

    def release_cuda_graphs(self) -> None:
        if self.graphs or self.mixed_graphs:
            torch.cuda.synchronize(self.device)
            self.graphs.clear()
            self.mixed_graphs.clear()
            self.shared_graphs.clear()
            self.shared_mixed_graphs.clear()
            self.graph_logits.clear()
            self.sampler_graphs = None
            torch.cuda.empty_cache()

    def _replay_graph(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy the step's inputs into the graph's static buffers and replay; the graph's (hidden, residual)."""
        bs = len(step.seq_lens)
        graph_bs = next(s for s in self.graph_batch_sizes if s >= bs)
        width = max(len(b) for b in step.block_tables)
        if width > self.g_max_blocks:
            raise RuntimeError("sequence longer than max_model_len reached the decode graph")
        i = self.num_replays % 2
        stage_blob, (stage_i64, stage_seq_lens, stage_order, stage_tables, stage_shared) = (self.stage_blobs[i],
                                                                                             self.stages[i])
        self.num_replays += 1
        ints = stage_i64.numpy()  # [3, max_bs]: input ids, positions, slots
        ints[0, :bs] = step.input_ids
        ints[1, :bs] = step.positions
        ints[2, :bs] = step.slot_mapping
        ints[0, bs:graph_bs] = 0
        ints[1, bs:graph_bs] = 0
        ints[2, bs:graph_bs] = -1
        lens = stage_seq_lens.numpy()
        lens[:bs] = step.seq_lens
        lens[bs:graph_bs] = 0
        tables = stage_tables.numpy()  # [max_bs, max_blocks]
        fill_tables(tables, step.block_tables)
        shared = self._stage_shared_prefix(tables, lens, bs, graph_bs, stage_order.numpy(), stage_shared.numpy())
        graph = self._shared_prefix_graph(graph_bs) if shared else self.graphs[graph_bs]
        prefix = self.g_off_tables + bs * self.g_max_blocks * 4  # bytes up to the last table row used
        if prefix <= SINGLE_UPLOAD_BYTES:  # one copy: a latency, not bandwidth, for a few rows
            self.g_blob[:prefix].copy_(stage_blob[:prefix], non_blocking=True)
        else:  # only the rows and table columns in use
            self.g_i64[:, :graph_bs].copy_(stage_i64[:, :graph_bs], non_blocking=True)
            lens_order = slice(self.g_off_lens, self.g_off_tables)  # lengths and order: adjacent, one copy
            self.g_blob[lens_order].copy_(stage_blob[lens_order], non_blocking=True)
            self.g_block_tables[:bs, :width].copy_(stage_tables[:bs, :width], non_blocking=True)
        self._feed_back(self.g_input_ids, step)
        graph.replay()
        hidden, residual = (self.shared_outputs if shared else self.graph_outputs)[graph_bs]
        return hidden[:bs], residual[:bs] if residual is not None else None

    def _stage_shared_prefix(self, tables: np.ndarray, lens: np.ndarray, rows: int, capacity: int, order: np.ndarray,
                             shared: np.ndarray) -> bool:
        """Stage a graph's decode-attention program order ([capacity]) and, where the step's `rows` one-token rows
        share pages (shared_prefix_plan), each group's shared tokens; whether they do. lens [capacity]: 0 past
        `rows`. Either way the graph's padding rows (length 0) come last."""
        plan = (shared_prefix_plan(tables, lens[:rows], self.block_size, self.shared_seqs) if self.shared_prefix_ok
                else None)
        if plan is None:  # the ordinary kernel's programs take the longest sequences first
            order[:capacity] = np.argsort(-lens[:capacity], kind="stable")
            return False
        order[:rows], groups = plan
        order[rows:capacity] = np.arange(rows, capacity)
        shared[: len(groups)] = groups
        shared[len(groups) : self._shared_groups(capacity)] = 0
        return True

    def _logits_graph_for(self, step: StepInput) -> int:
        """The size of the decode graph that replays `step` and computes its logits, or 0 (none does)."""
        bs = len(step.seq_lens)
        if not (step.decode_only and self.graph_logits and bs <= self.logits_graph_max_rows):
            return 0
        return next(s for s in self.graph_batch_sizes if s >= bs)

    def _mixed_graph_for(self, step: StepInput) -> tuple[int, int] | None:
        """The key of the smallest mixed graph that holds `step` (fewest tokens, then fewest chunks), or None (the
        step runs eagerly)."""
        num_tokens, d = len(step.input_ids), step.num_decode_rows
        if num_tokens > self.mixed_graph_sizes[-1] or max(len(b) for b in step.block_tables) > self.g_max_blocks:
            return None
        tokens = next(s for s in self.mixed_graph_sizes if s >= num_tokens)
        d_cap, p_cap = self._mixed_capacity(tokens)
        p = len(step.seq_lens) - d
        if d > d_cap or p > p_cap:
            return None
        few = (tokens, MIXED_FEW_CHUNKS)
        return few if p <= MIXED_FEW_CHUNKS and few in self.mixed_graphs else (tokens, p_cap)

    def _replay_mixed_graph(self, step: StepInput, key: tuple[int, int]) -> tuple[Final, Final | None]:
        """Stage a step with prompt chunks into the buffers of the mixed graph `key` (tokens, chunk capacity) and
        replay it; (hidden, residual) of each sequence's last row, and of step.logit_rows (None without)."""
        num_tokens, num_seqs, d = len(step.input_ids), len(step.seq_lens), step.num_decode_rows
        tokens, p_cap = key
        d_cap = self._mixed_capacity(tokens)[0]
        p = num_seqs - d
        stage = self.m_stages[self.num_mixed_replays % 2]
        self.num_mixed_replays += 1
        ints = stage["i64"].numpy()  # [3, T]: input ids, positions, slots
        ints[0, :num_tokens] = step.input_ids
        ints[1, :num_tokens] = step.positions
        ints[2, :num_tokens] = step.slot_mapping
        ints[:2, num_tokens:tokens] = 0
        ints[2, num_tokens:tokens] = -1
        qsl = np.asarray(step.query_start_loc, dtype=np.int64)
        lens = np.asarray(step.seq_lens, dtype=np.int32)
        stage["last"].numpy()[:num_seqs] = qsl[1:] - 1
        dec_lens = stage["dec_lens"].numpy()
        dec_lens[:d] = lens[:d]
        dec_lens[d:d_cap] = 0
        pre_qsl = stage["pre_qsl"].numpy()
        pre_qsl[: p + 1] = qsl[d:]
        pre_qsl[p + 1 : p_cap + 1] = num_tokens
        pre_lens = stage["pre_lens"].numpy()
        pre_lens[:p] = lens[d:]
        pre_lens[p:p_cap] = 0
        width = max(len(b) for b in step.block_tables)
        dec_tables, pre_tables = stage["dec_tables"].numpy(), stage["pre_tables"].numpy()
        fill_tables(dec_tables, step.block_tables[:d])
        fill_tables(pre_tables, step.block_tables[d:])
        shared = self._stage_shared_prefix(dec_tables, dec_lens, d, d_cap, stage["dec_order"].numpy(),
                                           stage["shared"].numpy())
        graph = self._shared_mixed_graph(key) if shared else self.mixed_graphs[key]
        m = self.m
        m["i64"][:, :tokens].copy_(stage["i64"][:, :tokens], non_blocking=True)
        m["last"][:num_seqs].copy_(stage["last"][:num_seqs], non_blocking=True)
        m["i32"].copy_(stage["i32"], non_blocking=True)
        if d:
            m["dec_tables"][:d, :width].copy_(stage["dec_tables"][:d, :width], non_blocking=True)
        if p:
            m["pre_tables"][:p, :width].copy_(stage["pre_tables"][:p, :width], non_blocking=True)
        self._feed_back(m["i64"][0], step)
        graph.replay()
        outputs = (self.shared_mixed_outputs if shared else self.mixed_outputs)[key]
        return _rows(outputs, m["last"][:num_seqs]), self._logit_rows(outputs, step)


def _rows(final: Final, index: torch.Tensor) -> Final:
    hidden, residual = final
    return hidden.index_select(0, index), None if residual is None else residual.index_select(0, index)


def _prompt_logprob_targets(batch: ScheduledBatch) -> tuple[list[int], list[int]]:
    """The prompt token each position of the batch's prompt_logit_spans predicts, and each span's k."""
    targets: list[int] = []
    ks: list[int] = []
    for i, lo, hi in batch.prompt_logit_spans:
        seq = batch.seqs[i]
        targets.extend(seq.token_ids[lo + 1 : hi + 1])
        ks.append(seq.sampling_params.prompt_logprobs or 0)
    return targets, ks


def fill_tables(out: np.ndarray, tables: list[list[int]]) -> None:
    """Row i of `out` starts with table i; entries past a table's length keep what they held (kernels read a
    sequence's table only up to its length). A sequence's table (BlockTable) is copied from its int32 mirror."""
    for i, b in enumerate(tables):
        out[i, : len(b)] = b.array() if type(b) is BlockTable else b


def _pad_tables(tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(tables), max(len(b) for b in tables)), dtype=np.int32)
    fill_tables(out, tables)
    return out
