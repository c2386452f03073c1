"""The job loop: the main thread steps the engine, the reader thread feeds it, lines go out.

    reader thread ──add_request──▶ engine ◀──step()── main thread ──▶ LineWriter ──▶ JSONL
          └──────── events (error lines, wake-ups, eof) ─────────────▶┘      ▲
                                          lines with logprobs ──▶ FormatPool ┘ (worker processes)

The engine lives on the main thread only (add_request is its one thread-safe entry point).
Ctrl-C once: stop reading, finish the requests already in the engine, write them, exit 130.
Ctrl-C twice: abort what is running, write every finished line at once, exit 130.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from nvcli.engine.protocol import Engine, EngineStats
from nvcli.jobs import jsonio
from nvcli.jobs.format_pool import FormatPool, has_logprobs
from nvcli.jobs.formatting import FormatContext, error_line, result_line
from nvcli.jobs.reader import InputReader, ReaderCounts
from nvcli.jobs.requests import ENGINE_ERROR, Defaults, LineError, Request
from nvcli.jobs.shards import Shard
from nvcli.jobs.writer import LineWriter, OutputClosed, OutputWriteError

EXIT_OK = 0
EXIT_LINE_ERRORS = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM: a batch scheduler's stop, drained like Ctrl-C
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE, as `seq 1e9 | head -1` reports under pipefail


@dataclass
class JobOptions:
    defaults: Defaults = field(default_factory=Defaults)
    ordered: bool = True
    max_in_flight: int = 1024  # lines in the engine plus lines in the reorder buffer
    model_name: str = "model"
    done: dict[str, bool] = field(default_factory=dict)  # --resume: id key -> was an error line
    handle_sigint: bool = True
    # processes that format lines with logprobs (format_pool.py); 0: the main thread formats every line
    format_workers: int = 0
    # where the reader's warnings (an unknown field, said once) go without a reporter (--quiet)
    warn: Callable[[str], None] | None = None
    # --num-shards / --shard-index: serve only this shard's lines (shards.py); None: every line
    shard: Shard | None = None


@dataclass
class JobProgress:
    """What the dashboard shows; a snapshot taken on the main thread."""

    elapsed_s: float
    written: int  # output lines written by this run
    failed: int  # ... of which error lines
    skipped: int  # lines answered by an earlier run (--resume)
    read: int  # input lines read so far
    in_flight: int  # requests in the engine
    buffered: int  # finished lines waiting for earlier ones (ordered output)
    total: int | None  # non-blank input lines (of this shard), when known (files); None for pipes
    prompt_tokens: int
    completion_tokens: int
    stats: EngineStats | None = None
    draining: bool = False
    model_name: str = ""

    @property
    def done(self) -> int:
        return self.written + self.skipped


class Reporter(Protocol):
    def update(self, progress: JobProgress) -> None: ...
    def log(self, message: str) -> None: ...


@dataclass
class JobResult:
    written: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    counts: ReaderCounts = field(default_factory=ReaderCounts)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    interrupted: bool = False  # Ctrl-C or SIGTERM: the input was not read to its end
    terminated: bool = False  # ... by SIGTERM
    aborted: bool = False  # second Ctrl-C: running requests were dropped
    output_closed: bool = False  # our reader went away (BrokenPipe)
    formatted_apart: int = 0  # lines formatted by the worker processes (format_pool.py)
    stats: Any = None

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    @property
    def answered_all(self) -> bool:
        """Every line of the input has its output line: read to its end, nothing dropped (a stop signal that came
        once the last lines were in flight leaves nothing to resume)."""
        return self.counts.exhausted and not self.aborted and not self.output_closed

    @property
    def succeeded(self) -> int:
        return self.written - self.failed

    @property
    def exit_code(self) -> int:
        if self.output_closed:
            return EXIT_OUTPUT_CLOSED
        if self.interrupted:
            return EXIT_TERMINATED if self.terminated else EXIT_INTERRUPTED
        if self.failed or self.counts.skipped_errors:
            return EXIT_LINE_ERRORS
        return EXIT_OK


class LineCounter(threading.Thread):
    """Count the non-blank lines of an input file (those a shard owns, with `shard`) in the background (for the
    ETA)."""

    def __init__(self, path: Path | str, shard: Shard | None = None) -> None:
        super().__init__(name="nv-line-counter", daemon=True)
        self.path = Path(path)
        self.shard = shard
        self.total: int | None = None

    def run(self) -> None:
        n = 0
        try:
            with open(self.path, "rb") as f:
                for line_no, raw in enumerate(f):
                    if raw.strip() and (self.shard is None or self.shard.owns(line_no)):
                        n += 1
        except OSError:
            return
        self.total = n


class _Job:
    def __init__(self, engine: Engine, src: Iterable[bytes], dst: BinaryIO, opts: JobOptions,
                 reporter: Reporter | None, counter: LineCounter | None) -> None:
        self.engine = engine
        self.opts = opts
        self.reporter = reporter
        self.counter = counter
        self.events: queue.Queue = queue.Queue()
        self.slots = threading.Semaphore(max(1, opts.max_in_flight))
        self.pending: dict[str, Request] = {}
        self.reader = InputReader(src, engine, opts.defaults, self.events, self.slots, self.pending, opts.done,
                                  opts.shard)
        self.writer = LineWriter(dst, ordered=opts.ordered, slots=self.slots)
        self.ctx = FormatContext(model_name=opts.model_name, tokenizer=engine.tokenizer,
                                 # the engine's own setting: its constraint gate and this split read one value
                                 reasoning_parser=engine.config.reasoning_parser,
                                 raw_json=jsonio.FRAGMENTS)  # the writer and the pool's workers write with jsonio
        self.result = JobResult(counts=self.reader.counts)
        self.pool: FormatPool | None = None  # started at the first line with logprobs
        self.pool_failed = False
        self.formatting: deque[tuple[Request, Any, Future[bytes]]] = deque()  # in the pool, in submission order
        self.reader_done = False
        self.draining = False
        self.interrupts = 0
        self.t0 = time.monotonic()
        self.last_report = 0.0

    # -- signals -------------------------------------------------------------------------
    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        """Ctrl-C or SIGTERM (what a batch scheduler or `kill` sends first): the first drains, the second aborts the
        requests in flight, a third raises."""
        if self.interrupts == 0:
            self.result.terminated = signum == signal.SIGTERM
        self.interrupts += 1
        if self.interrupts >= 3:
            raise KeyboardInterrupt

    # -- main loop -----------------------------------------------------------------------
    def run(self) -> JobResult:
        old: dict[int, Any] = {}
        if self.opts.handle_sigint and threading.current_thread() is threading.main_thread():
            old = {sig: signal.signal(sig, self._on_stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.reader.start()
        try:
            self._loop()
        except OutputClosed:
            self.result.output_closed = True
            self._abort_all()
        except BaseException:
            self._abort_all()
            try:
                self._collect(wait=True)  # finished lines still being formatted
                self.writer.flush_buffered()
            except (OutputClosed, OutputWriteError):
                pass
            raise
        finally:
            self.reader.stop()
            if self.pool is not None:
                self.pool.shutdown()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self.result.written = self.writer.written
            self.result.errors = self.writer.errors
            self.result.elapsed_s = time.monotonic() - self.t0
            self.result.stats = _stats(self.engine)
            self._report(force=True)
        return self.result

    def _loop(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            self._drain_events(block=not busy)
            if self.interrupts and not self.draining:
                self.draining = True
                self.result.interrupted = True
                self.reader.stop()
                again = "SIGTERM again" if self.result.terminated else "Ctrl-C again"
                self._log(f"{'terminated' if self.result.terminated else 'interrupted'}: finishing the requests in "
                          f"flight ({again} to abort them)")
            if self.interrupts >= 2:
                self.result.aborted = True
                self._abort_all()
                self._collect(wait=True)
                n = self.writer.flush_buffered()
                self._log(f"aborted: dropped the requests in flight, wrote {n} finished lines out of order")
                return
            if engine.has_unfinished():
                for out in engine.step():
                    self._finish(out)
                self._collect(wait=False)
            elif self.formatting:  # the engine is idle: wait for the pool once no more input can come
                if self.pool is not None and not self.pool.ready.is_set():
                    self.pool.take_waiting()  # not started yet: this thread has nothing else to do
                self._collect(wait=(self.reader_done or self.draining) and self.events.empty())
            elif (self.reader_done or self.draining) and self.events.empty():
                if self.pending:  # the engine forgot requests it accepted: answer them anyway
                    for rid in list(self.pending):
                        req = self.pending.pop(rid)
                        err = LineError(req.line_no, req.id, req.key, req.shape, ENGINE_ERROR,
                                        "the engine dropped this request without an answer", req.custom_id)
                        self.writer.put(req.ordinal, error_line(err), ENGINE_ERROR)
                    continue
                return
            self._report()

    def _drain_events(self, block: bool) -> None:
        timeout = 0.05 if block else None
        while True:
            try:
                ev = self.events.get(timeout=timeout) if timeout else self.events.get_nowait()
            except queue.Empty:
                return
            timeout = None
            kind = ev[0]
            if kind == "line":
                self.writer.put(ev[1], ev[2], ev[3])
            elif kind == "submitted":
                if ev[2] and self.pool is None:  # the first line with logprobs: start the pool before it finishes
                    self._start_pool()
            elif kind == "eof":
                self.reader_done = True
            elif kind == "warn":
                if self.reporter is None and self.opts.warn is not None:
                    self.opts.warn(ev[1])
                self._log(ev[1])
            elif kind == "failed":
                raise RuntimeError(f"reading the input failed: {ev[1]}") from ev[1]

    def _finish(self, out: Any) -> None:
        req = self.pending.pop(out.request_id, None)
        if req is None:
            return
        if self.opts.format_workers > 0 and not self.pool_failed and has_logprobs(out):
            if self.pool is None:
                self._start_pool()
            try:
                if self.pool is not None:
                    if self.pool.error is not None:
                        raise self.pool.error
                    self.formatting.append((req, out, self.pool.submit(req, out)))  # waits there for the workers
                    return
            except Exception as e:  # noqa: BLE001 - a broken pool: this thread formats
                self._pool_failed(e)
        self._put(req, out, *self._format(req, out))

    def _start_pool(self) -> None:
        if self.opts.format_workers <= 0 or self.pool_failed:
            return
        try:
            self.pool = FormatPool(self._pool_context(), self.opts.format_workers)
        except Exception as e:  # noqa: BLE001 - no pool: this thread formats
            self._pool_failed(e)

    def _pool_context(self) -> FormatContext:
        """The workers' context: the engine's token texts go with it, so that a worker shows the texts this thread
        would (and does not decode a vocabulary of its own)."""
        return dataclasses.replace(self.ctx, vocabulary=self.engine.token_texts())

    def _format(self, req: Request, out: Any) -> tuple[dict[str, Any] | bytes, str | None]:
        try:
            return result_line(req, out, self.ctx), None
        except Exception as e:  # noqa: BLE001 - a formatting bug must not cost the line
            err = LineError(req.line_no, req.id, req.key, req.shape, ENGINE_ERROR,
                            f"could not format the output: {e}", req.custom_id)
            return error_line(err), ENGINE_ERROR

    def _put(self, req: Request, out: Any, line: dict[str, Any] | bytes, kind: str | None) -> None:
        if kind is None:
            self.result.prompt_tokens += len(out.prompt_token_ids)
            self.result.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.writer.put(req.ordinal, line, kind)

    def _collect(self, wait: bool) -> None:
        """Write the pool's finished lines, in submission order (with `wait`, every line it holds). A line whose
        formatting failed there is formatted here: a bug gives the same error line as on this thread, a dead
        worker costs nothing."""
        if wait and self.pool is not None and not self.pool.ready.is_set():
            self.pool.take_waiting()
        while self.formatting:
            req, out, fut = self.formatting[0]
            if not wait and not fut.done():
                return
            self.formatting.popleft()
            try:
                line = fut.result()
            except Exception as e:  # noqa: BLE001
                if isinstance(e, BrokenProcessPool):
                    self._pool_failed(e)
                self._put(req, out, *self._format(req, out))
            else:
                self.result.formatted_apart += 1
                self._put(req, out, line, None)

    def _pool_failed(self, e: BaseException) -> None:
        if not self.pool_failed:
            self.pool_failed = True
            self._log(f"formatting processes failed ({type(e).__name__}: {e}); formatting on the main thread")

    def _abort_all(self) -> None:
        self.reader.stop()
        for rid in list(self.pending):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001, S110 - best effort on the way out
                pass
        self.pending.clear()

    # -- progress ------------------------------------------------------------------------
    def _log(self, msg: str) -> None:
        if self.reporter is not None:
            self.reporter.log(msg)

    def _report(self, force: bool = False) -> None:
        if self.reporter is None:
            return
        now = time.monotonic()
        if not force and now - self.last_report < 0.25:
            return
        self.last_report = now
        self.reporter.update(self.progress(now))

    def progress(self, now: float | None = None) -> JobProgress:
        now = time.monotonic() if now is None else now
        c = self.reader.counts
        return JobProgress(
            elapsed_s=now - self.t0,
            written=self.writer.written,
            failed=sum(self.writer.errors.values()),
            skipped=c.skipped,
            read=c.lines - c.blank - c.other_shards,
            in_flight=len(self.pending),
            buffered=self.writer.buffered + len(self.formatting),
            total=self.counter.total if self.counter is not None else None,
            prompt_tokens=self.result.prompt_tokens,
            completion_tokens=self.result.completion_tokens,
            stats=_stats(self.engine),
            draining=self.draining,
            model_name=self.opts.model_name,
        )


def _stats(engine: Engine) -> EngineStats | None:
    try:
        return engine.stats()
    except Exception:  # noqa: BLE001 - the dashboard must never end a job
        return None


def run_job(
    engine: Engine,
    src: Iterable[bytes],
    dst: BinaryIO,
    opts: JobOptions | None = None,
    reporter: Reporter | None = None,
    counter: LineCounter | None = None,
) -> JobResult:
    """Serve every line of `src` with `engine`, writing one output line per input line to `dst`."""
    return _Job(engine, src, dst, opts or JobOptions(), reporter, counter).run()
