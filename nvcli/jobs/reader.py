"""The reader thread: read JSONL lines, build requests, feed the engine while it runs.

It parses each line, renders chat templates, and calls `engine.add_request` (thread-safe);
it never steps the engine. Lines that cannot be served become error lines right here. Before a
line that will produce output it takes a slot from `slots`, so a file of a million lines or an
endless pipe is never read far ahead of the engine.

Everything it produces goes to the main thread through `events`:
  ("line", ordinal, line_dict, error_kind)   an error line, ready to write
  ("submitted", ordinal)                     a request went into the engine (wakes the loop)
  ("warn", message)                          something the user should know, said once
  ("eof", None)                              the input is exhausted (or the reader was stopped)
  ("failed", exception)                      reading the input itself failed
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from nvcli.jobs.formatting import error_line
from nvcli.jobs.requests import (
    DUPLICATE_ID,
    ENGINE_ERROR,
    INVALID_JSON,
    INVALID_REQUEST,
    NATIVE,
    PROMPT_TOO_LONG,
    Defaults,
    LineError,
    Request,
    parse_line,
)


@dataclass
class ReaderCounts:
    lines: int = 0  # physical lines read, blank ones included
    blank: int = 0
    skipped: int = 0  # answered in the output already (--resume)
    skipped_errors: int = 0  # ... of which error lines
    outputs: int = 0  # lines that will get an output line in this run


class InputReader(threading.Thread):
    def __init__(
        self,
        stream: Iterable[bytes],
        engine: Any,
        defaults: Defaults,
        events: queue.Queue,
        slots: threading.Semaphore,
        pending: dict[str, Request],
        done: dict[str, bool] | None = None,
    ) -> None:
        super().__init__(name="nv-reader", daemon=True)
        self.stream = stream
        self.engine = engine
        self.defaults = defaults
        self.events = events
        self.slots = slots
        self.pending = pending
        self.done = done or {}
        self.counts = ReaderCounts()
        self.seen: set[str] = set()
        self.submit_lock = threading.Lock()
        self._stopped = False
        self._warned: set[str] = set()
        self._shape = NATIVE  # last shape seen: used for lines too broken to tell theirs

    def stop(self) -> None:
        """Stop submitting: after this returns no new line will produce output."""
        with self.submit_lock:
            self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            self.events.put(("warn", f"{msg} (first seen on line {self.counts.lines})"))

    def run(self) -> None:
        try:
            for line_no, raw in enumerate(self.stream):
                self.counts.lines = line_no + 1
                if self._stopped:
                    break
                if not raw.strip():
                    self.counts.blank += 1
                    continue
                if not self._handle(raw, line_no):
                    break
        except Exception as e:  # noqa: BLE001 - handed to the main thread, which reports it
            self.events.put(("failed", e))
        finally:
            self.events.put(("eof", None))

    def _handle(self, raw: bytes, line_no: int) -> bool:
        item = parse_line(raw, line_no, self.defaults, self._warn, self._shape)
        if isinstance(item, Request) or item.kind != INVALID_JSON:
            self._shape = item.shape
        if item.key in self.done:
            self.counts.skipped += 1
            self.counts.skipped_errors += self.done[item.key]
            return True
        if item.key in self.seen:
            item = LineError(
                line_no, item.id, item.key, item.shape, DUPLICATE_ID,
                f"duplicate id {item.id!r}: it was already used by an earlier line; ids must be unique",
                item.custom_id,
            )
        else:
            self.seen.add(item.key)
        if not self._take_slot():
            return False
        if isinstance(item, Request):
            item = self._submit(item)
            if item is None:
                return True
            if item is False:
                self.slots.release()
                return False
        with self.submit_lock:
            if self._stopped:
                self.slots.release()
                return False
            item.ordinal = self.counts.outputs
            self.counts.outputs += 1
            self.events.put(("line", item.ordinal, error_line(item), item.kind))
        return True

    def _take_slot(self) -> bool:
        while not self.slots.acquire(timeout=0.1):
            if self._stopped:
                return False
        return True

    def _submit(self, req: Request) -> LineError | None | bool:
        """Put `req` into the engine. None: submitted; a LineError: rejected; False: stopped."""
        prompt: str | list[int]
        try:
            if req.messages is not None:
                prompt = self.engine.render_chat(req.messages, req.chat_template_kwargs or None)
                req.prompt_token_ids = prompt
            elif req.prompt_token_ids is not None:
                prompt = req.prompt_token_ids
            else:
                prompt = req.prompt
        except Exception as e:  # noqa: BLE001 - a template error belongs to this line only
            return _reject(req, INVALID_REQUEST, f"could not render the chat template: {e}")
        with self.submit_lock:
            if self._stopped:
                return False
            rid = f"nv-{self.counts.outputs}"
            req.ordinal = self.counts.outputs
            self.pending[rid] = req
            try:
                self.engine.add_request(prompt, req.sampling_params, request_id=rid)
            except ValueError as e:
                del self.pending[rid]
                return _reject(req, _classify(str(e), req, self.engine), str(e))
            except Exception as e:  # noqa: BLE001
                del self.pending[rid]
                return _reject(req, ENGINE_ERROR, f"the engine refused the request: {e}")
            self.counts.outputs += 1
            self.events.put(("submitted", req.ordinal))
        return None


def _reject(req: Request, kind: str, message: str) -> LineError:
    return LineError(req.line_no, req.id, req.key, req.shape, kind, message, req.custom_id)


def _classify(message: str, req: Request, engine: Any) -> str:
    n = len(req.prompt_token_ids) if req.prompt_token_ids is not None else None
    max_len = getattr(engine, "max_model_len", None)
    if (n is not None and max_len is not None and n > max_len) or "max_model_len" in message or "too long" in message:
        return PROMPT_TOO_LONG
    return INVALID_REQUEST



def iter_fd_lines(fd: int, chunk_size: int = 1 << 16) -> Iterator[bytes]:
    """Lines of a file descriptor, read with os.read: no buffered-reader lock.

    The reader thread is a daemon; if it sits in a read of sys.stdin.buffer when the process
    exits (Ctrl-C with the pipe still open), the interpreter aborts trying to take that
    object's lock. os.read holds no such lock. Lines keep their b"\n"; a line may be any length.
    """
    pending: list[bytes] = []
    while True:
        chunk = os.read(fd, chunk_size)
        if not chunk:
            break
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            if i < 0:
                if start < len(chunk):
                    pending.append(chunk[start:])
                break
            piece = chunk[start : i + 1]
            if pending:
                pending.append(piece)
                piece = b"".join(pending)
                pending = []
            yield piece
            start = i + 1
    if pending:
        yield b"".join(pending)
