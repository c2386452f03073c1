"""`--resume`: find which ids an earlier run already answered, repairing a torn last line.

Every line nv writes ends with a newline and goes out in one write, so a run killed mid-write
(SIGKILL, power loss) can leave at most one incomplete line, at the end, without its newline.
`scan_output` cuts that tail off (and a final line that is not valid JSON), then reads the
answered ids. Keys are ids (see `requests.id_key`), never prompt text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from nvcli.jobs import jsonio
from nvcli.jobs.requests import id_key


class ResumeError(Exception):
    """The output file cannot be resumed; the message says why and what to do."""


@dataclass
class ResumeState:
    done: dict[str, bool] = field(default_factory=dict)  # id key -> True if that line is an error line
    lines: int = 0
    repaired_bytes: int = 0  # bytes of a torn last line that were cut off

    @property
    def num_errors(self) -> int:
        return sum(self.done.values())


def is_error_line(obj: dict) -> bool:
    if obj.get("error") is not None:
        return True
    resp = obj.get("response")
    return isinstance(resp, dict) and resp.get("status_code") not in (None, 200)


def scan_output(path: Path | str) -> ResumeState:
    """Repair `path` in place (drop a torn last line) and return the ids it answers."""
    path = Path(path)
    state = ResumeState()
    if not path.exists():
        return state
    if not path.is_file():
        raise ResumeError(f"--resume: output {str(path)!r} is not a regular file")
    _repair_tail(path, state)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = jsonio.loads(raw)
                rid = obj["id"]
                if not (isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool))):
                    raise TypeError
            except (jsonio.JSONDecodeError, ValueError, KeyError, TypeError):
                raise ResumeError(
                    f"--resume: line {n} of {str(path)!r} is not an nv output line (JSON with an \"id\"); "
                    "fix or remove it, or write to a new file"
                ) from None
            state.done[id_key(rid)] = is_error_line(obj) or state.done.get(id_key(rid), False)
            state.lines += 1
    return state


def _repair_tail(path: Path, state: ResumeState) -> None:
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "r+b") as f:
        keep = _last_newline_end(f, size)
        if keep == size:  # ends with a newline: check that the last line is whole JSON
            start = _last_newline_end(f, size - 1)
            f.seek(start)
            last = f.read(size - start)
            try:
                jsonio.loads(last)
            except (jsonio.JSONDecodeError, ValueError):
                keep = start
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
            state.repaired_bytes = size - keep


def _last_newline_end(f, end: int) -> int:
    """Offset just past the last b"\\n" in f[:end] (0 if there is none)."""
    chunk = 1 << 16
    pos = end
    while pos > 0:
        start = max(0, pos - chunk)
        f.seek(start)
        buf = f.read(pos - start)
        i = buf.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0
