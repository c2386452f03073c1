"""Write output lines: one `write` plus a flush per line, in input order or as completed.

Ordered mode keeps finished lines in a reorder buffer until every earlier line is out. The
buffer is bounded from outside: the reader takes one slot per output line before it submits
it and the writer frees the slot once the line is written, so lines in the engine plus lines
in the buffer never exceed the slot count.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, BinaryIO

from nvcli.jobs import jsonio


class OutputClosed(Exception):
    """The reader of our output went away (`nv generate ... | head -1`)."""


class OutputWriteError(OSError):
    """The output could not be written (a full disk, /dev/full, an I/O error): the job cannot go on."""


class LineWriter:
    def __init__(self, stream: BinaryIO, ordered: bool = True, slots: threading.Semaphore | None = None) -> None:
        self.stream = stream
        self.ordered = ordered
        self.slots = slots
        self.next_ordinal = 0
        self.buffer: dict[int, tuple[dict[str, Any] | bytes, str | None]] = {}
        self.written = 0
        self.errors: Counter[str] = Counter()  # error kind -> lines

    def put(self, ordinal: int, line: dict[str, Any] | bytes, error_kind: str | None = None) -> None:
        """Hand over output line number `ordinal` (0-based over this run's output lines): its object, or its JSON
        already serialized (format_pool.py)."""
        if not self.ordered:
            self._write(line, error_kind)
            return
        self.buffer[ordinal] = (line, error_kind)
        while self.next_ordinal in self.buffer:
            self._write(*self.buffer.pop(self.next_ordinal))
            self.next_ordinal += 1

    def flush_buffered(self) -> int:
        """Write whatever waits in the reorder buffer, out of order (used when aborting)."""
        n = 0
        for ordinal in sorted(self.buffer):
            self._write(*self.buffer.pop(ordinal))
            n += 1
        return n

    @property
    def buffered(self) -> int:
        return len(self.buffer)

    def _write(self, line: dict[str, Any] | bytes, error_kind: str | None) -> None:
        data = (line if isinstance(line, bytes) else jsonio.dumps(line)) + b"\n"
        try:
            self.stream.write(data)
            self.stream.flush()
        except BrokenPipeError as e:
            raise OutputClosed() from e
        except OSError as e:
            raise OutputWriteError(e.errno, e.strerror or str(e)) from e
        self.written += 1
        if error_kind is not None:
            self.errors[error_kind] += 1
        if self.slots is not None:
            self.slots.release()
