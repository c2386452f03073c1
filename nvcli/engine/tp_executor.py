"""Tensor parallelism: rank 0 in the engine's process, ranks 1..N-1 as spawned worker processes.

Each step, rank 0 packs the StepInput into a shared-memory buffer as int32 arrays (no pickling)
and sets every worker's event; all ranks then run the forward together, joined by
torch.distributed (NCCL on GPU, gloo on CPU). Port and shared-memory names are unique per run,
so two jobs can share a host. A watchdog ends the job within a second or two if a worker dies,
and workers exit on their own if the engine's process goes away: no hangs, no orphans.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from nvcli import distributed, env
from nvcli.attention.backend import fill_tables
from nvcli.child_processes import exit_with_parent
from nvcli.config import EngineConfig
from nvcli.engine import startup
from nvcli.engine.model_runner import ModelRunner
from nvcli.engine.sampling_stage import SamplingInputs, StepHandle, StepResult, TokenMasks, collect
from nvcli.engine.scheduler import ScheduledBatch
from nvcli.engine.step_input import StepInput, build_step_input

if TYPE_CHECKING:
    from nvcli.kernels.compile_ahead import CompileWorkers
    from nvcli.models.model_config import ModelConfig

CMD_STEP, CMD_EXIT = 1, 2


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited; the job cannot go on."""
_HEADER = 9  # int32 words: cmd, decode_only, num_tokens, num_seqs, width, pending, decode rows, logit rows, draft rows


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def channel_words(config: EngineConfig) -> int:
    max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    max_blocks = -(-(config.max_model_len or 0) // config.kvcache_block_size) + 1
    seqs = config.max_num_seqs
    return _HEADER + 5 * max_tokens + 2 * seqs + 1 + seqs * max_blocks + 2 * seqs  # draft rows < tokens


def pack_step(buf: np.ndarray, step: StepInput, cmd: int = CMD_STEP) -> None:
    n, s = len(step.input_ids), len(step.seq_lens)
    width = max(len(b) for b in step.block_tables)
    buf[:_HEADER] = (cmd, int(step.decode_only), n, s, width, len(step.pending), step.num_decode_rows,
                     len(step.logit_rows), len(step.draft_rows))
    o = _HEADER
    for arr in (step.input_ids, step.positions, step.slot_mapping):
        buf[o : o + n] = arr
        o += n
    buf[o : o + s + 1] = step.query_start_loc
    o += s + 1
    buf[o : o + s] = step.seq_lens
    o += s
    tables = buf[o : o + s * width].reshape(s, width)
    tables.fill(0)
    fill_tables(tables, step.block_tables)
    o += s * width
    if step.pending:
        buf[o : o + 2 * len(step.pending)] = [x for pair in step.pending for x in pair]
    o += 2 * len(step.pending)
    buf[o : o + len(step.logit_rows)] = step.logit_rows
    o += len(step.logit_rows)
    buf[o : o + len(step.draft_rows)] = step.draft_rows


def unpack_step(buf: np.ndarray) -> tuple[int, StepInput | None]:
    cmd, decode_only, n, s, width, num_pending, num_decode_rows, num_logit_rows, num_draft_rows = (
        int(x) for x in buf[:_HEADER])
    if cmd != CMD_STEP:
        return cmd, None
    o = _HEADER
    ids, pos, slots = (buf[o + i * n : o + (i + 1) * n].tolist() for i in range(3))
    o += 3 * n
    qsl = buf[o : o + s + 1].tolist()
    o += s + 1
    seq_lens = buf[o : o + s].tolist()
    o += s
    tables = buf[o : o + s * width].reshape(s, width).tolist()
    o += s * width
    flat = buf[o : o + 2 * num_pending].tolist()
    pending = list(zip(flat[0::2], flat[1::2]))
    o += 2 * num_pending
    logit_rows = buf[o : o + num_logit_rows].tolist()
    o += num_logit_rows
    draft_rows = buf[o : o + num_draft_rows].tolist()
    return cmd, StepInput(ids, pos, slots, qsl, seq_lens, tables, bool(decode_only), pending, num_decode_rows,
                          logit_rows, draft_rows)


# Decode and small mixed steps all-reduce through symmetric memory (distributed.init_symmetric_all_reduce); larger
# prefill chunks keep NCCL, which is bandwidth-optimal there. The buffer holds this many rows of hidden_size.
SYMM_ALL_REDUCE_MAX_ROWS = 2048
# Rows up to which a row-parallel projection's sum is deferred into the next add+RMSNorm (distributed.Partial): from
# TP 3 on, 1,024 over the square of the tensor-parallel size (64 at TP 4); at TP 2 every step's, prompt steps
# included, up to DEFERRED_SUM_ROWS_TP2 (two buffers of that many rows of hidden_size per GPU: 268 MB for a hidden
# size of 4,096)
DEFERRED_SUM_ROWS = 1024
DEFERRED_SUM_ROWS_TP2 = 16384


def _init_dist(config: EngineConfig, model_config: ModelConfig, rank: int, port: int) -> None:
    backend = "nccl" if config.resolved_device() == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", world_size=config.tensor_parallel_size, rank=rank,
        timeout=timedelta(minutes=30),
    )
    if backend == "nccl":
        # Here, before ModelRunner, so that the KV cache, sized from free GPU memory, counts this buffer as in use.
        # cuda:rank and the dtype as ModelRunner picks them.
        rows = min(config.max_num_batched_tokens, SYMM_ALL_REDUCE_MAX_ROWS)
        distributed.init_symmetric_all_reduce(rows * model_config.hidden_size, startup.pick_dtype(config, "cuda"),
                                              torch.device("cuda", rank))
        # Deferred sums read every peer's whole share (one shot), against the two-shot all-reduce's half and
        # half. At TP 2 both read one share, and the one shot, without the copies and the separate norm, takes
        # 56-63% of the symmetric all-reduce path's time from 64 to 2,048 rows, and at 4,096-16,384 rows 62-68%
        # of NCCL's all-reduce and the norm after it; from TP 3 on it reads more and wins only while
        # rows x (ranks - 1) stays small (benchmarks/allreduce_gpu.py, benchmarks/RESULTS.md)
        tp = config.tensor_parallel_size
        most = DEFERRED_SUM_ROWS_TP2 if tp == 2 else DEFERRED_SUM_ROWS // tp ** 2
        deferred_rows = min(config.max_num_batched_tokens, most)
        distributed.init_deferred_sums(deferred_rows * model_config.hidden_size, startup.pick_dtype(config, "cuda"),
                                       torch.device("cuda", rank))


def worker_main(config: EngineConfig, model_config: ModelConfig, model_dir: str, rank: int, port: int, shm_name: str,
                event, ack) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 coordinates shutdown on Ctrl-C
    exit_with_parent()
    stacks_after_s = env.settings().debug_stacks_after_s
    if stacks_after_s is not None:  # diagnosing a hang: print this worker's stacks
        import faulthandler

        faulthandler.dump_traceback_later(stacks_after_s, exit=False)
    _init_dist(config, model_config, rank, port)
    runner = ModelRunner(config, model_config, Path(model_dir), rank=rank)
    shm = SharedMemory(name=shm_name)
    buf = np.ndarray((shm.size // 4,), dtype=np.int32, buffer=shm.buf)
    try:
        while True:
            event.wait()
            event.clear()
            cmd, step = unpack_step(buf)
            ack.set()  # the channel is free for the next step while this one runs
            if cmd == CMD_EXIT:
                break
            assert step is not None
            runner.execute(step)
    finally:
        del buf
        shm.close()
        runner.release_cuda_graphs()
        distributed.release_symmetric_all_reduce()  # after the graphs that captured it, before its group
        distributed.release_deferred_sums()
        if dist.is_initialized():
            dist.destroy_process_group()


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path,
                 compile_workers: CompileWorkers | None = None) -> None:
        """`compile_workers`: rank 0's, already started (startup.start_compile_workers_if_cold)."""
        self.config = config
        self.block_size = config.kvcache_block_size
        world = config.tensor_parallel_size
        if config.resolved_device() == "cuda" and torch.cuda.device_count() < world:
            from nvcli.config import ConfigError

            raise ConfigError(f"--tensor-parallel-size={world} needs {world} GPUs; {torch.cuda.device_count()} visible")
        _check_divisible(model_config, world)
        from nvcli.models.layers.fp8 import check_tp_split

        row_parallel = {"o_proj": model_config.num_attention_heads * model_config.head_dim}
        if _has_dense_mlp(model_config):
            row_parallel["down_proj"] = model_config.intermediate_size
        if model_config.num_experts:  # each expert's gate / up rows and down columns split alike
            row_parallel["the experts' down_proj"] = model_config.moe_intermediate_size
        check_tp_split(model_config.quantization, row_parallel, world)
        self.shm = SharedMemory(name=f"nv-{os.getpid()}-{uuid.uuid4().hex[:12]}", create=True,
                                size=4 * channel_words(config))
        self.buf = np.ndarray((self.shm.size // 4,), dtype=np.int32, buffer=self.shm.buf)
        ctx = mp.get_context("spawn")
        port = free_port()
        self.events = [ctx.Event() for _ in range(1, world)]
        self.acks = [ctx.Event() for _ in range(1, world)]
        for a in self.acks:
            a.set()
        self.procs = [
            ctx.Process(target=worker_main, name=f"nv-tp-worker-{r}",
                        args=(config, model_config, str(model_dir), r, port, self.shm.name, self.events[r - 1],
                              self.acks[r - 1]),
                        daemon=True)
            for r in range(1, world)
        ]
        for p in self.procs:
            p.start()
        self._closed = False
        atexit.register(self.shutdown)
        self._watchdog = threading.Thread(target=self._watch_workers, daemon=True)
        self._watchdog.start()
        try:
            _init_dist(config, model_config, 0, port)
            self.runner = ModelRunner(config, model_config, model_dir, rank=0, compile_workers=compile_workers)
        except BaseException:
            self._cleanup(kill=True)
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def _dead_worker(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return (f"tensor-parallel worker rank {rank} died (exit code {p.exitcode}); stopping. "
                        "Lines already written are complete: rerun with --resume to finish the job.")
        return None

    def _watch_workers(self) -> None:
        """Rank 0 may be stuck in a collective that never completes: end the process from here."""
        while not self._closed:
            msg = self._dead_worker()
            if msg is not None and not self._closed:
                sys.stderr.write(f"nv: error: {msg}\n")
                sys.stderr.flush()
                self._cleanup(kill=True)
                os._exit(70)
            time.sleep(0.2)

    supports_async = True  # rank 0 broadcasts each step's tokens; workers fill pending inputs from them

    def launch(self, batch: ScheduledBatch, prev: StepHandle | None) -> StepHandle:
        step = build_step_input(batch, self.block_size, prev.row_of if prev is not None else None)
        for a in self.acks:  # every worker has read the previous step out of the channel
            while not a.wait(timeout=1.0):
                if self._dead_worker() is not None:
                    self._worker_died(None)
            a.clear()
        pack_step(self.buf, step)
        for e in self.events:
            e.set()
        try:
            return self.runner.launch(step, SamplingInputs.of(batch))
        except Exception as e:
            self._worker_died(e)
            raise

    def sample(self, handle: StepHandle, masks: TokenMasks | None = None) -> None:
        try:
            self.runner.sample(handle, masks)  # rank 0 samples for every rank (and broadcasts the tokens)
        except Exception as e:
            self._worker_died(e)
            raise

    def collect(self, handle: StepHandle) -> StepResult:
        try:
            return collect(handle)
        except Exception as e:
            self._worker_died(e)
            raise

    def _worker_died(self, cause: Exception | None) -> None:
        """Raise WorkerDiedError if a worker is gone (gloo reports it as a connection error)."""
        deadline = time.monotonic() + 2.0
        while (msg := self._dead_worker()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if msg is None:
            return
        self._cleanup(kill=True)
        raise WorkerDiedError(msg) from cause

    def _cleanup(self, kill: bool) -> None:
        self._closed = True
        for p in self.procs:
            if p.is_alive():
                p.kill() if kill else p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        try:  # unlink first: it works even while this process still maps the segment
            self.shm.unlink()
        except FileNotFoundError:
            pass
        try:
            del self.buf
            self.shm.close()
        except (AttributeError, BufferError):
            pass

    def shutdown(self) -> None:
        if self._closed:
            return
        for a in self.acks:  # do not overwrite a step a worker has not read yet
            a.wait(timeout=5.0)
        self.buf[:_HEADER] = (CMD_EXIT,) + (0,) * (_HEADER - 1)
        for e in self.events:
            e.set()
        # Graphs that captured NCCL collectives must go before the communicator: on two H200s,
        # destroy_process_group hung with them alive (eager mode shut down cleanly).
        self.runner.release_cuda_graphs()
        distributed.release_symmetric_all_reduce()  # after the graphs that captured it, before its group
        distributed.release_deferred_sums()
        self._cleanup(kill=False)
        if dist.is_initialized():
            # Never let a stuck communicator turn a finished job into a hang.
            t = threading.Thread(target=dist.destroy_process_group, daemon=True)
            t.start()
            t.join(timeout=15)


def _has_dense_mlp(model_config: ModelConfig) -> bool:
    """Whether some layer has a dense MLP of intermediate_size (a mixture-of-experts model may have none: its
    intermediate_size then sizes nothing, and need not split across the ranks)."""
    return any(not model_config.is_moe_layer(i) for i in range(model_config.num_hidden_layers))


def _check_divisible(model_config: ModelConfig, world: int) -> None:
    from nvcli.config import ConfigError

    heads = model_config.num_attention_heads
    kv_heads = model_config.num_key_value_heads
    sizes = [("num_attention_heads", heads), ("num_key_value_heads", kv_heads)]
    if _has_dense_mlp(model_config):
        sizes.append(("intermediate_size", model_config.intermediate_size))
    if model_config.num_experts:  # each expert's intermediate dimension is split across the ranks (layers/moe.py)
        sizes.append(("moe_intermediate_size", model_config.moe_intermediate_size))
    for name, value in sizes:
        if value % world:
            raise ConfigError(
                f"--tensor-parallel-size={world}: the model's {name}={value} is not divisible by it; "
                "choose a size that divides the attention and KV head counts"
            )
