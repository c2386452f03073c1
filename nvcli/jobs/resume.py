"""`--resume`: find which ids an earlier run already answered, repairing a torn last line.

Every line nv writes ends with a newline and goes out in one write, so a run killed mid-write
(SIGKILL, power loss) can leave at most one incomplete line, at the end, without its newline.
`scan_output` cuts that tail off (and a final line that is not valid JSON), then reads the
answered ids. Keys are ids (see `requests.id_key`), never prompt text, except for the error lines that answer an input
line by its position (`requests.line_key`): a line whose id could not be read (`"id": null`), and a duplicate id's
error line, whose id belongs to an earlier line that may still be unanswered.

`--retry-errors` takes the error lines out of the file (rewritten beside it, then renamed over it) so that their input
lines are served again, for instance after raising the `--max-model-len` a `prompt_too_long` line asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvcli.jobs import jsonio
from nvcli.jobs.requests import DUPLICATE_ID, id_key, line_key


class ResumeError(Exception):
    """The output file cannot be resumed; the message says why and what to do."""


@dataclass
class ResumeState:
    done: dict[str, bool] = field(default_factory=dict)  # id key -> True if that line is an error line
    lines: int = 0
    repaired_bytes: int = 0  # bytes of a torn last line that were cut off
    retried: int = 0  # error lines taken out of the file to be served again (--retry-errors)

    @property
    def num_errors(self) -> int:
        return sum(self.done.values())


def is_error_line(obj: dict) -> bool:
    if obj.get("error") is not None:
        return True
    resp = obj.get("response")
    return isinstance(resp, dict) and resp.get("status_code") not in (None, 200)


def scan_output(path: Path | str, retry_errors: bool = False) -> ResumeState:
    """Repair `path` in place (drop a torn last line) and return the ids it answers; with `retry_errors`, first take
    its error lines out."""
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
            key, error = _answered(raw, n, path)
            if error and retry_errors:
                state.retried += 1
                continue
            state.done[key] = error or state.done.get(key, False)
            state.lines += 1
    if state.retried:
        _drop_error_lines(path)
    return state


def _drop_error_lines(path: Path) -> None:
    """Rewrite `path` without its error lines (and blank lines): beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.nv-resume")
    try:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            for raw in src:
                if raw.strip() and not is_error_line(jsonio.loads(raw)):
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def output_key(obj: Any) -> tuple[str, bool]:
    """(key, is an error line) of a parsed output line: the key of the input line it answers (see the module's
    docstring). Raises KeyError, TypeError or ValueError where `obj` is not an nv output line."""
    rid = obj["id"]
    error = is_error_line(obj)
    if rid is None or (error and _error_field(obj, "type", "code") == DUPLICATE_ID):
        line = error_line_number(obj)
        if line is None:
            raise TypeError
        return line_key(line - 1), True
    if not (isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool))):
        raise TypeError
    return id_key(rid), error


def error_line_number(obj: dict) -> int | None:
    """The 1-based input line number an error line names ("line"); None for a line that is no error line or names
    none."""
    if not is_error_line(obj):
        return None
    line = _error_field(obj, "line", "line")
    return line if isinstance(line, int) and not isinstance(line, bool) and line >= 1 else None


def _answered(raw: bytes, n: int, path: Path) -> tuple[str, bool]:
    """(key, is an error line) of output line n."""
    try:
        return output_key(jsonio.loads(raw))
    except (jsonio.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise ResumeError(
            f"--resume: line {n} of {str(path)!r} is not an nv output line (JSON with an \"id\"); "
            "fix or remove it, or write to a new file"
        ) from None


def _error_field(obj: dict, native: str, openai: str) -> object:
    """A field of an error line's error: {"error": {...}} (native) or response.body.error (OpenAI)."""
    err = obj.get("error")
    if isinstance(err, dict):
        return err.get(native)
    body = (obj.get("response") or {}).get("body")
    err = body.get("error") if isinstance(body, dict) else None
    return err.get(openai) if isinstance(err, dict) else None


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
