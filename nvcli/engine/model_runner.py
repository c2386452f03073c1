"""Runs the model for one scheduled step: the coordinator of the runner's rooms.

One ModelRunner per tensor-parallel rank. Rank 0 builds a StepInput (engine/step_input.py) from the scheduler's
batch; every rank runs the forward, from a CUDA graph (engine/cuda_graphs.py) or eagerly with the attention
backend's metadata (attention/backend.py); rank 0 then samples (engine/sampling_stage.py). Start-up (weights,
compile-ahead, warm-up) is engine/startup.py, KV-cache sizing engine/kv_sizing.py.

A step on rank 0 is two calls, so that the engine can read the step before it in between:
`launch` enqueues the forward and the logits and returns; `sample` enqueues sampling and the copies to the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from nvcli.attention.backend import AttentionBackend
from nvcli.attention.metadata import AttentionMetadata
from nvcli.config import EngineConfig
from nvcli.engine import kv_sizing, sampler_graphs, startup
from nvcli.engine.cuda_graphs import CudaGraphs
from nvcli.engine.sampling_stage import SamplingInputs, SamplingStage, StepHandle, TokenMasks
from nvcli.engine.step_input import Final, Ints, StepInput
from nvcli.models.layers.attention import Attention
from nvcli.uploads import upload

if TYPE_CHECKING:
    from nvcli.kernels.compile_ahead import CompileWorkers
    from nvcli.models.model_config import ModelConfig

log = logging.getLogger("nvcli")

# prompt_logprobs: the LM head runs over at most this many bytes of logits (in the model's dtype) at a time
PROMPT_LOGITS_CHUNK_BYTES = 256 << 20


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path, rank: int = 0,
                 compile_workers: CompileWorkers | None = None) -> None:
        """`compile_workers`: started by the caller for this start-up (startup.start_compile_workers_if_cold); else
        the runner starts them itself if it compiles ahead."""
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.device = torch.device("cpu") if config.resolved_device() == "cpu" else torch.device("cuda", rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = startup.pick_dtype(config, self.device.type)
        self.block_size = config.kvcache_block_size
        self.max_table_width = -(-(config.max_model_len or model_config.max_position_embeddings) // self.block_size)
        self.prev_tokens = torch.zeros(0, dtype=torch.int64)  # the last step's sampled tokens (device)
        # Pipelined tensor parallelism: workers need rank 0's tokens to fill pending inputs.
        broadcast = bool(config.async_scheduling) and config.tensor_parallel_size > 1
        self.sampling = SamplingStage(self.device, config.seed, broadcast)
        # prompt_logprobs: the LM head's rows per chunk (a multiple of 16), at most PROMPT_LOGITS_CHUNK_BYTES of logits
        # (on the CPU the torch form makes float32 temporaries of a chunk's size too)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.logit_chunk_rows = max(16, PROMPT_LOGITS_CHUNK_BYTES // (elem * model_config.vocab_size) // 16 * 16)
        self.startup_s: dict[str, float] = {}  # wall seconds of each start-up phase (logged; benchmarks/startup.py)
        t0 = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal t0
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.startup_s[name] = now - t0
            t0 = now

        marker, workers = startup.compile_plan(config, model_config, rank, self.device, compile_workers)
        self.model = startup.load_model(config, model_config, model_dir, self.device, self.dtype)
        phase("weights")
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        from nvcli.kernels.shared_prefix_attention import seqs_per_group  # triton: imported on demand

        layer = self.attn_layers[0]
        self.attention = AttentionBackend(self.device, self.block_size, self.max_table_width,
                                          seqs_per_group(layer.num_heads, layer.num_kv_heads), config.batch_invariant)
        self.cuda_graphs: CudaGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            # decode graphs of a few rows end with the LM head (not under TP, whose LM head gathers across ranks)
            logits_rows = sampler_graphs.MAX_ROWS if config.tensor_parallel_size == 1 else 0
            self.cuda_graphs = CudaGraphs(self.model, self.attention, self.device, config.max_num_seqs,
                                          config.max_num_batched_tokens, not config.batch_invariant, logits_rows)
        if marker is not None:
            try:
                num_variants, dry_s = startup.compile_ahead(self, workers)
            finally:
                if workers is not None:
                    workers.shutdown()
            phase("compile_ahead")
            log.info("rank %d compiled %d Triton kernel variants ahead of start-up in %.1f s (dry pass %.1f s, %s)",
                     rank, num_variants, self.startup_s["compile_ahead"], dry_s,
                     f"{workers.num_workers} processes" if workers is not None else "threads")
        self.num_kvcache_blocks = kv_sizing.allocate(self)
        phase("kv_cache")
        if self.cuda_graphs is not None:
            from nvcli.kernels.shared_prefix_attention import (
                supports_shared_prefix,  # triton: imported on demand
            )

            self.attention.shared_prefix = (bool(self.cuda_graphs.shared_keys())
                                            and supports_shared_prefix(layer.kv))  # bound by allocate above
            rows = self.cuda_graphs.logits_max_rows if rank == 0 else 0
            self.cuda_graphs.capture_all(sampler_graphs.SamplerGraphs(rows, model_config.vocab_size, self.device)
                                         if rows else None)
            self.sampling.sampler_graphs = self.cuda_graphs.sampler_graphs
            phase("cuda_graphs")
        if self.device.type == "cuda":
            startup.warm_up_kernels(self)
            kv_sizing.recache_prefill_activations(self)
            phase("kernel_warm_up")
        if marker is not None:
            marker.write(num_variants)
        log.info("rank %d start-up: %s", rank, ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items()))

    # ------------------------------------------------------------------ forward
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

    def _upload(self, x: Ints | np.ndarray, dtype: type) -> torch.Tensor:
        return upload_ints(x, dtype, self.device)

    def eager_inputs(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A step's input ids, positions and attention metadata on the device, uploaded without waiting for it."""
        return eager_inputs(self.attention, self.device, step)

    @torch.inference_mode()
    def forward(self, step: StepInput) -> Final:
        """The last token of each sequence: the final norm's inputs (hidden, residual), [num_seqs, hidden] each
        (residual None where the model returns the residual stream itself: deferred norm, models/llama.py)."""
        return self._forward_rows(step)[0]

    def _forward_rows(self, step: StepInput) -> tuple[Final, Final | None, torch.Tensor | None, int]:
        """forward's rows, then those of `step.draft_rows`; the same of `step.logit_rows` (None without); the logits
        [num_seqs, vocab] where a graph computed them (else None), and that graph's size (else 0)."""
        key = self.cuda_graphs.key_for(step) if self.cuda_graphs is not None else None
        if key is not None:
            done = self.cuda_graphs.replay(step, key, lambda ids: self._feed_back(ids, step))
            extra = self._logit_rows(done.outputs, step) if key.chunks else None
            final = done.final
            if len(step.draft_rows):  # a mixed graph (a verify row has 2+ tokens): every row is in its outputs
                final = _cat(final, _rows(done.outputs, self._upload(step.draft_rows, np.int64)))
            return final, extra, done.logits, key.tokens if done.logits is not None else 0
        input_ids, positions, meta = self.eager_inputs(step)
        self._feed_back(input_ids, step)
        hidden, residual = self.model(input_ids, positions, meta)  # [num_tokens, hidden] each
        if step.decode_only:  # one token per sequence: every row is a last token
            return (hidden, residual), None, None, 0
        last = meta.query_start_loc[1:].long() - 1
        if len(step.draft_rows):  # speculative decoding's verify rows sample there too, after every last row
            last = torch.cat([last, self._upload(step.draft_rows, np.int64)])
        return _rows((hidden, residual), last), self._logit_rows((hidden, residual), step), None, 0

    def _logit_rows(self, final: Final, step: StepInput) -> Final | None:
        """The final norm's inputs of step.logit_rows; on a GPU padded (the last row repeated) to whole chunks of
        `logit_chunk_rows`, so that the LM head and the reductions meet one shape, not a new one every step
        (cuBLAS pays milliseconds of host time for each row count it has not seen)."""
        n = len(step.logit_rows)
        if not n:
            return None
        index = np.asarray(step.logit_rows, dtype=np.int64)
        if self.device.type == "cuda" and n % self.logit_chunk_rows:
            index = np.concatenate([index, np.full(self.logit_chunk_rows - n % self.logit_chunk_rows, index[-1])])
        return _rows(final, upload(torch.from_numpy(index), self.device))

    def prompt_logit_chunks(self, rows: Final) -> Iterator[torch.Tensor]:
        """Logits [<= logit_chunk_rows, vocab] of `rows`, a bounded chunk at a time: a 16k-token prompt step's logits
        in one piece would take 5 GB in bf16. Every TP rank runs the same chunks (the LM head gathers the vocab)."""
        hidden, residual = rows
        chunk = self.logit_chunk_rows
        for a in range(0, hidden.shape[0], chunk):
            yield self.model.compute_logits(hidden[a : a + chunk], None if residual is None else residual[a : a + chunk])

    @torch.inference_mode()
    def forward_logits(self, step: StepInput) -> torch.Tensor:
        """Logits [num_seqs, vocab] (float32) of each sequence's last token; no sampling."""
        return self.model.compute_logits(*self.forward(step)).float()

    # ------------------------------------------------------------------ a step
    @torch.inference_mode()
    def execute(self, step: StepInput) -> None:
        """A tensor-parallel worker's share of a step (rank 0 runs launch and sample)."""
        final, extra, _, _ = self._forward_rows(step)
        self.model.compute_logits(*final)  # the vocab-parallel gather needs every rank
        if self.sampling.broadcast_tokens:  # rank 0's sampled tokens, for the next step's pending inputs
            rows = len(step.seq_lens) + len(step.draft_rows)  # rank 0 samples every row of `final`
            self.prev_tokens = torch.empty(rows, dtype=torch.int64, device=self.device)
            torch.distributed.broadcast(self.prev_tokens, src=0)
        for _ in self.prompt_logit_chunks(extra) if extra is not None else ():  # rank 0 runs them after the broadcast
            pass

    @torch.inference_mode()
    def launch(self, step: StepInput, inputs: SamplingInputs) -> StepHandle:
        """Enqueue the step's forward and logits (rank 0); returns before the device is done. `sample` follows."""
        final, extra, logits, graph_rows = self._forward_rows(step)
        if logits is None:
            logits = self.model.compute_logits(*final)  # [num_seqs, vocab] in the model dtype; the sampler upcasts
        return StepHandle(inputs, logits, self.prompt_logit_chunks(extra) if extra is not None else None,
                          0 if extra is None else extra[0].shape[0], graph_rows)

    def sample(self, handle: StepHandle, masks: TokenMasks | None = None) -> None:
        """Enqueue a launched step's sampling and its copies to the host (SamplingStage.sample)."""
        self.prev_tokens = self.sampling.sample(handle, masks)

    def release_cuda_graphs(self) -> None:
        if self.cuda_graphs is not None:
            self.cuda_graphs.release()
            self.sampling.sampler_graphs = None


def upload_ints(x: Ints | np.ndarray, dtype: type, device: torch.device) -> torch.Tensor:
    return upload(torch.from_numpy(np.asarray(x, dtype=dtype)), device)  # numpy: torch.tensor(list) is ~3x slower


def eager_inputs(attention: AttentionBackend, device: torch.device, step: StepInput
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step's input ids, positions and attention metadata on `device`, uploaded without waiting for it (the
    target's eager steps and the draft model's, engine/draft_model.py)."""
    input_ids, positions = upload_ints(step.input_ids, np.int64, device), upload_ints(step.positions, np.int64, device)
    meta = attention.metadata(upload_ints(step.slot_mapping, np.int64, device), step.query_start_loc, step.seq_lens,
                              step.block_tables, step.decode_only, step.num_decode_rows,
                              lambda a: upload(torch.from_numpy(a), device))
    return input_ids, positions, meta


def _cat(a: Final, b: Final) -> Final:
    return torch.cat([a[0], b[0]]), None if a[1] is None or b[1] is None else torch.cat([a[1], b[1]])


def _rows(final: Final, index: torch.Tensor) -> Final:
    hidden, residual = final
    return hidden.index_select(0, index), None if residual is None else residual.index_select(0, index)
