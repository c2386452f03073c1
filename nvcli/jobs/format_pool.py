"""Output lines with logprobs, formatted in worker processes.

A scoring job (lm-eval-harness's `echo` with `logprobs`, or `prompt_logprobs`) turns every prompt token into a few
JSON objects: about 2 ms of Python per 1,000-token line. On the job's main thread that time comes between engine
steps, and the GPU waits for it (a 768-line scoring job took 2-3x its engine's time on the H100 host). Here such
lines are formatted in processes of their own (forked from a `forkserver`): the main thread only pickles the request and
its output (0.3 ms for a 1,000-token scoring line, against 1.8 ms to format it) and writes the bytes that come back.

Lines without logprobs stay on the main thread: their formatting costs about as much as sending them.
A worker that dies (or a pool that cannot start) costs no line: the runner stops using the pool and formats those
lines itself (runner._Job._collect).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from nvcli.child_processes import exit_with_parent
from nvcli.jobs import jsonio
from nvcli.jobs.formatting import FormatContext, result_line
from nvcli.jobs.requests import Request
from nvcli.outputs import RequestOutput

_ctx: FormatContext | None = None  # a worker's context, set by _start_worker


def default_workers(device: str) -> int:
    """Formatting processes for a job whose engine runs on `device`: a quarter of the cores, at most 4, none for a
    CPU engine (its matmuls use every core) or on a machine of fewer than 4 cores."""
    return 0 if device != "cuda" else min(4, (os.cpu_count() or 1) // 4)


def asks_logprobs(req: Request) -> bool:
    """The request's output will carry per-token logprobs (has_logprobs)."""
    return req.sampling_params.logprobs is not None or req.sampling_params.prompt_logprobs is not None


def has_logprobs(out: RequestOutput) -> bool:
    """The output carries per-token logprobs, which are what makes a line costly to format."""
    return out.prompt_logprobs is not None or any(c.logprobs for c in out.outputs)


class DecodeOnly:
    """What formatting uses of a tokenizer, `decode`, over transformers' Rust tokenizer alone: a worker then loads
    `tokenizers` (0.4 s for Qwen3's) instead of importing transformers (2-3 s, and 10 s for two workers at once on
    the H100 host). Equal to the tokenizer's own decode where that applies no clean-up (`decode_only`). It loads at
    its first decode: a worker reads logprobs' texts from the job's vocabulary table (FormatContext.vocabulary), so
    only lines that decode ids (an echoed token-id prompt's text) need it, and a scoring job's workers start 0.3 s
    sooner without it."""

    def __init__(self, backend_json: str) -> None:
        self.backend_json = backend_json
        self._backend: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"backend_json": self.backend_json, "_backend": None}

    def decode(self, ids: Any) -> str:
        if self._backend is None:
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(self.backend_json)
        return self._backend.decode(list(ids), skip_special_tokens=False)


def decode_only(tokenizer: Any) -> Any:
    """A DecodeOnly for a transformers tokenizer that decodes with its Rust tokenizer and no clean-up, else the
    tokenizer itself (sent whole: slower to start, the same lines)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return tokenizer
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, TokenizersBackend) and not tokenizer.clean_up_tokenization_spaces
             and cls.decode is TokenizersBackend.decode and cls._decode is TokenizersBackend._decode)
    if plain:
        return DecodeOnly(tokenizer.backend_tokenizer.to_str())
    return tokenizer


def _forkserver() -> multiprocessing.context.BaseContext:
    """Workers forked from a server that has imported the formatting code: they start about 1 s sooner than
    `spawn`ed ones, which import it each. Not `fork`: the job's process has threads (the
    engine's), and a forked copy of their locks can deadlock."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["nvcli.jobs.format_pool", "tokenizers"])
    return ctx


def _start_worker(ctx: FormatContext) -> None:
    global _ctx
    # A session of its own: Ctrl-C (or a kill of the job's process group) reaches the job, which drains and still
    # needs its lines formatted. The executor's own SIGTERM, sent when a worker of a broken pool died, still ends a
    # worker: one that ignored it left the executor joining it forever under Python 3.12.
    try:
        os.setsid()
    except OSError:  # already a session's leader
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()  # a job killed outright takes its workers with it
    # the job may write its lines to stdout: nothing a worker prints (a library's notice) may land among them
    os.dup2(2, 1)
    _ctx = ctx


def format_line(req: Request, out: RequestOutput) -> bytes:
    """The line's JSON (in a worker process)."""
    assert _ctx is not None, "format_line runs in a FormatPool worker"
    return jsonio.dumps(result_line(req, out, _ctx))


class NotFormatted(Exception):
    """A line handed back before the workers started (FormatPool.take_waiting): its submitter formats it."""


class FormatPool:
    """`workers` processes formatting lines with `ctx`; its tokenizer goes to each once, as a DecodeOnly where it
    can.

    Starting a worker can block whoever submits the task that starts it until the new process has read its context,
    so a thread of its own starts them (1-3 s on the H100 host). Lines submitted before they are `ready`
    wait, and go to the workers once they are: a job whose main thread formatted them meanwhile held the GIL against
    the engine's step loop (a scoring job's first 50-230 lines, about 20-30 ms each at 20 alternatives).
    A submitter with nothing else to do takes them back (`take_waiting`) and formats them itself.
    """

    def __init__(self, ctx: FormatContext, workers: int) -> None:
        if workers < 1:
            raise ValueError("a FormatPool needs at least one worker")
        sent = dataclasses.replace(ctx, tokenizer=decode_only(ctx.tokenizer)) if ctx.tokenizer is not None else ctx
        self.executor = ProcessPoolExecutor(max_workers=workers, mp_context=_forkserver(),
                                            initializer=_start_worker, initargs=(sent,))
        self.ready = threading.Event()
        self.error: BaseException | None = None  # why the workers did not start
        self._lock = threading.Lock()
        self._waiting: list[tuple[Future[bytes], Request, RequestOutput]] = []  # submitted before `ready`
        threading.Thread(target=self._start, args=(workers,), name="nv-format-pool", daemon=True).start()

    def _start(self, workers: int) -> None:
        try:
            for fut in [self.executor.submit(os.getpid) for _ in range(workers)]:
                fut.result()
        except BaseException as e:  # noqa: BLE001 - reported through `error`; the job formats on its own thread
            self.error = e
            for proxy, _, _ in self._take():
                proxy.set_exception(e)
            return
        with self._lock:
            self.ready.set()
            waiting, self._waiting = self._waiting, []
        for proxy, req, out in waiting:
            _forward(self._submit_now(req, out), proxy)

    def _submit_now(self, req: Request, out: RequestOutput) -> Future[bytes]:
        try:
            return self.executor.submit(format_line, req, out)
        except BaseException as e:  # noqa: BLE001 - a pool shut down meanwhile: the submitter formats the line
            failed: Future[bytes] = Future()
            failed.set_exception(e)
            return failed

    def submit(self, req: Request, out: RequestOutput) -> Future[bytes]:
        """The line's JSON, formatted by a worker (once they have started)."""
        with self._lock:
            if not self.ready.is_set():
                proxy: Future[bytes] = Future()
                self._waiting.append((proxy, req, out))
                return proxy
        return self.executor.submit(format_line, req, out)

    def take_waiting(self) -> list[tuple[Future[bytes], Request, RequestOutput]]:
        """The lines still waiting for the workers to start, taken back: each one's future fails with NotFormatted."""
        waiting = self._take()
        for proxy, _, _ in waiting:
            proxy.set_exception(NotFormatted())
        return waiting

    def _take(self) -> list[tuple[Future[bytes], Request, RequestOutput]]:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        return waiting

    def shutdown(self) -> None:
        self.take_waiting()
        self.executor.shutdown(wait=False, cancel_futures=True)


def _forward(real: Future[bytes], proxy: Future[bytes]) -> None:
    """`proxy` gets `real`'s outcome when it has one."""
    def done(f: Future[bytes]) -> None:
        if f.cancelled():
            proxy.cancel()
        elif f.exception() is not None:
            proxy.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            proxy.set_result(f.result())
    real.add_done_callback(done)
