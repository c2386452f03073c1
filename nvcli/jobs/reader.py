"""The reader thread: read JSONL lines, build requests, feed the engine while it runs.

It takes the lines that have arrived (up to BATCH_LINES; a thread of its own reads the input),
parses them, renders chat templates, tokenizes all their prompts in one `engine.encode_batch`
call, and calls `engine.add_request` (thread-safe) for each in input order; it never steps the
engine. One tokenizer call per batch matters: the tokenizer then works on all cores outside the
GIL, where a call per line held the GIL against the engine's own thread and fed a prompt-heavy
job 21% slower than the GPU prefills. Lines that cannot be served become
error lines right here. Before a line that will produce output it takes a slot from `slots`, so
a file of a million lines or an endless pipe is never read far ahead of the engine.

Everything it produces goes to the main thread through `events`:
  ("line", ordinal, line_dict, error_kind)   an error line, ready to write
  ("submitted", ordinal, logprobs)           a request went into the engine (wakes the loop); whether it asks
                                             for logprobs (the job starts its formatting processes then)
  ("warn", message)                          something the user should know, said once
  ("eof", None)                              the input is exhausted (or the reader was stopped)
  ("failed", exception)                      reading the input itself failed
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from nvcli.engine.protocol import Engine
from nvcli.jobs import tool_calls
from nvcli.jobs.format_pool import asks_logprobs
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
    line_key,
    parse_line,
)
from nvcli.jobs.shards import Shard

# Lines tokenized in one call at most. A batch is what has arrived, never a wait for more: a pipe
# that delivers one line at a time is served one line at a time.
BATCH_LINES = 64


@dataclass
class ReaderCounts:
    lines: int = 0  # physical lines read, blank ones included (other shards' lines too)
    blank: int = 0
    other_shards: int = 0  # lines passed over as other shards' (--shard-index; shards.py), up to the last line read
    skipped: int = 0  # answered in the output already (--resume)
    skipped_errors: int = 0  # ... of which error lines
    outputs: int = 0  # lines that will get an output line in this run
    exhausted: bool = False  # every line of the input was read (not stopped early)


class SeenIds:
    """The ids that lines have taken, for the duplicate-id check. Most jobs give no ids, and a line without one takes
    its line number (1-based): such a line (any line whose id is the integer of its own line number) is one bit of a
    bytearray instead of a dict entry of about 100-160 bytes (tracemalloc), so a job of ten million id-less lines
    keeps 1.25 MB here, not 1.5 GB. Other ids stay in a dict, with the line that took each. `line_no` arguments and
    answers are 0-based positions; the id of the line at position n is n + 1."""

    def __init__(self) -> None:
        self._others: dict[str, int] = {}  # id key -> the 0-based position of the line that has it
        self._own = bytearray()  # bit n: the line at position n has the id n + 1

    def claim(self, rid: str | int, key: str, line_no: int) -> int:
        """The first line with this id (key: its id_key), which is line_no when the id is new; it is then taken.
        Lines come in order."""
        if type(rid) is int and rid == line_no + 1:
            first = self._others.get(key)  # an earlier line that gave this number as its id
            if first is None:
                byte = line_no >> 3
                if byte >= len(self._own):
                    self._own.extend(bytes(max(byte + 1 - len(self._own), len(self._own))))
                self._own[byte] |= 1 << (line_no & 7)
                return line_no
            return first
        at = rid - 1 if type(rid) is int else -1  # the position of the line whose own number rid is
        if 0 <= at < line_no and at >> 3 < len(self._own) and self._own[at >> 3] >> (at & 7) & 1:
            return at  # an earlier line without an id took this number
        return self._others.setdefault(key, line_no)

    def owner(self, rid: str | int, key: str) -> int | None:
        """The position of the line that took this id (key: its id_key), or None (nv merge looks lines up here)."""
        at = rid - 1 if type(rid) is int else -1
        if 0 <= at and at >> 3 < len(self._own) and self._own[at >> 3] >> (at & 7) & 1:
            return at
        return self._others.get(key)


class InputReader(threading.Thread):
    def __init__(
        self,
        stream: Iterable[bytes],
        engine: Engine,
        defaults: Defaults,
        events: queue.Queue,
        slots: threading.Semaphore,
        pending: dict[str, Request],
        done: dict[str, bool] | None = None,
        shard: Shard | None = None,
    ) -> None:
        super().__init__(name="nv-reader", daemon=True)
        self.stream = stream
        self.engine = engine
        self.defaults = defaults
        self.events = events
        self.slots = slots
        self.pending = pending
        self.done = done or {}
        self.shard = shard  # None: every line; else only the lines this shard owns are served
        self.counts = ReaderCounts()
        self.seen = SeenIds()
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
            keep = self.shard.owns if self.shard is not None else None
            for batch in batched_lines(self.stream, BATCH_LINES, keep):
                if not self._handle_batch(batch):
                    break
            else:
                self.counts.exhausted = True
        except Exception as e:  # noqa: BLE001 - handed to the main thread, which reports it
            self.events.put(("failed", e))
        finally:
            self.events.put(("eof", None))

    def _handle_batch(self, batch: list[tuple[int, bytes]]) -> bool:
        """Parse the lines, tokenize their prompts in one call, then submit them in order."""
        items: list[Request | LineError] = []
        for line_no, raw in batch:
            self.counts.other_shards += line_no - self.counts.lines  # the lines `keep` passed over since the last
            self.counts.lines = line_no + 1
            if self._stopped:
                return False
            if not raw.strip():
                self.counts.blank += 1
                continue
            item = self._parse(raw, line_no)
            if item is not None:
                items.append(item)
        self._tokenize(items)
        return all(self._emit(item) for item in items)

    def _parse(self, raw: bytes, line_no: int) -> Request | LineError | None:
        """The line as a request or an error line; None when --resume finds it answered."""
        item = parse_line(raw, line_no, self.defaults, self._warn, self._shape)
        if isinstance(item, Request) or item.kind != INVALID_JSON:
            self._shape = item.shape
        if item.id is not None:
            first = self.seen.claim(item.id, item.key, line_no)  # also for a line --resume skips: its id is taken
            if first != line_no:
                item = LineError(
                    line_no, item.id, line_key(line_no), item.shape, DUPLICATE_ID,
                    f"duplicate id {item.id!r}: line {first + 1} already has it"
                    + (" (a line without an id takes its line number)" if isinstance(item.id, int) else "")
                    + "; ids must be unique",
                    item.custom_id,
                )
        if item.key in self.done:
            self.counts.skipped += 1
            self.counts.skipped_errors += self.done[item.key]
            return None
        return item

    def _tokenize(self, items: list[Request | LineError]) -> None:
        """Fill in prompt_token_ids of the text and chat requests; a chat whose template fails, or a
        prompt the tokenizer rejects, becomes that line's error."""
        plain: dict[int, str] = {}  # text prompts, by index in items
        rendered: dict[int, str] = {}  # chats
        for i, item in enumerate(items):
            if not isinstance(item, Request) or item.prompt_token_ids is not None:
                continue
            if item.messages is None:
                plain[i] = item.prompt
                continue
            try:
                if item.tools is None:
                    rendered[i] = self.engine.render_chat_text(item.messages, item.chat_template_kwargs or None)
                else:
                    rendered[i] = self._render_with_tools(item)
            except _Unservable as e:
                items[i] = _reject(item, INVALID_REQUEST, str(e))
            except Exception as e:  # noqa: BLE001 - a template error belongs to this line only
                items[i] = _reject(item, INVALID_REQUEST, f"could not render the chat template: {e}")
        self._encode_into(items, plain, add_special_tokens=True)
        self._encode_into(items, rendered, add_special_tokens=False)

    def _render_with_tools(self, req: Request) -> str:
        """A chat line that offers tools, rendered with them; its tool_choice "auto" gets the job's parser (the
        one --tool-call-parser names, or the one its chat template's format calls for)."""
        assert req.tools is not None and req.messages is not None
        template = tool_calls.template_text(self.engine.tokenizer, req.chat_template_kwargs)
        req.tools.parser = tool_calls.resolve_parser(self.defaults.tool_call_parser, template)
        problem = tool_calls.serving_problem(req.tools, template)
        if problem is not None:
            raise _Unservable(problem)
        return self.engine.render_chat_text(req.messages, req.chat_template_kwargs or None, tools=req.tools.tools)

    def _encode_into(self, items: list[Request | LineError], texts: dict[int, str], add_special_tokens: bool) -> None:
        """items[i].prompt_token_ids = the ids of texts[i], every text in one tokenizer call; when that call fails,
        each text alone, and the ones the tokenizer rejects become their line's error."""
        if not texts:
            return
        try:
            ids: list[list[int] | None] = list(self.engine.encode_batch(list(texts.values()), add_special_tokens))
        except Exception:  # noqa: BLE001 - find the line that broke it, alone
            ids = []
            for i, text in texts.items():
                try:
                    ids.append(self.engine.encode_batch([text], add_special_tokens)[0])
                except Exception as e:  # noqa: BLE001
                    ids.append(None)
                    items[i] = _reject(items[i], INVALID_REQUEST, f"could not tokenize the prompt: {e}")
        for i, token_ids in zip(texts, ids):
            if token_ids is not None:
                items[i].prompt_token_ids = token_ids

    def _emit(self, item: Request | LineError) -> bool:
        """Submit a request, or queue an error line, under a slot. False: the reader was stopped."""
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
        """Put `req` (tokenized by _tokenize) into the engine. None: submitted; a LineError: rejected;
        False: stopped."""
        with self.submit_lock:
            if self._stopped:
                return False
            rid = f"nv-{self.counts.outputs}"
            req.ordinal = self.counts.outputs
            self.pending[rid] = req
            try:
                self.engine.add_request(req.prompt_token_ids, req.sampling_params, request_id=rid,
                                        prompt_text=req.prompt, priority=req.priority)
            except ValueError as e:
                del self.pending[rid]
                return _reject(req, _classify(str(e), req, self.engine), str(e))
            except Exception as e:  # noqa: BLE001
                del self.pending[rid]
                return _reject(req, ENGINE_ERROR, f"the engine refused the request: {e}")
            self.counts.outputs += 1
            self.events.put(("submitted", req.ordinal, asks_logprobs(req)))
        return None


class _Unservable(Exception):
    """A line the engine could render but nv cannot answer as asked (its message is the line's error)."""


def _reject(req: Request, kind: str, message: str) -> LineError:
    return LineError(req.line_no, req.id, req.key, req.shape, kind, message, req.custom_id)


def _classify(message: str, req: Request, engine: Engine) -> str:
    if message.startswith(("truncate_prompt_tokens", "max_tokens")):  # the field is wrong, not the prompt
        return INVALID_REQUEST
    n = len(req.prompt_token_ids) if req.prompt_token_ids is not None else None
    max_len = engine.max_model_len
    if (n is not None and n > max_len) or "max_model_len" in message or "too long" in message:
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


def batched_lines(stream: Iterable[bytes], max_lines: int,
                  keep: Callable[[int], bool] | None = None) -> Iterator[list[tuple[int, bytes]]]:
    """(line number, line) lists of up to max_lines: the first line waits for input, the rest are
    the lines that have already arrived. A daemon thread reads `stream` at most 2 * max_lines
    ahead; an error reading it is raised here, after the lines before it. With `keep`, only the lines whose
    0-based physical line number it keeps (a shard's, shards.py) are handed on; the numbers stay the file's."""
    lines: queue.Queue = queue.Queue(maxsize=2 * max_lines)
    end = object()

    def feed() -> None:
        try:
            for item in enumerate(stream):
                if keep is None or keep(item[0]):  # dropped here, on the feeder thread: not queued for nothing
                    lines.put(item)
        except BaseException as e:  # noqa: BLE001 - re-raised on the reader thread
            lines.put(e)
        lines.put(end)

    threading.Thread(target=feed, name="nv-input", daemon=True).start()
    while True:
        batch: list[tuple[int, bytes]] = []
        item = lines.get()
        while True:
            if item is end:
                if batch:
                    yield batch
                return
            if isinstance(item, BaseException):
                if batch:
                    yield batch
                raise item
            batch.append(item)
            if len(batch) >= max_lines:
                break
            try:
                item = lines.get_nowait()
            except queue.Empty:
                break
        yield batch
