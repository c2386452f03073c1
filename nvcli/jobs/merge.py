"""`nv merge OUT SHARD...`: the outputs of `nv generate --num-shards K --shard-index I` (shards.py) as one file in
input order, as one unsharded job would have written it (byte for byte, but for OpenAI lines' random request ids).

The shard files come in shard-index order (0 to K - 1: K is their number). Each output line is placed by the input
line it answers: its key (resume.output_key: its id, or the line number of an error line that answers by position).
With `--input INPUT` the keys come from the input, read as the K shard jobs read it (shards.py), so the order is
exact and every missing line is known: the merge names the missing lines and the shard that owns each. Without it,
a line is placed by the line number it records (an error line's "line", or an integer id taken as the line number,
which it is for a line without an id); a line with a string id cannot be placed, and a missing line cannot be told
from a blank one.

Nothing is written unless the shards make a whole output: every line placed, owned by the shard whose file holds it,
answered once (a duplicate is refused, naming it), none missing. The output goes to a file beside OUT, renamed over
it at the end, so a failed merge leaves OUT as it was.

Memory: per output line two 8-byte integers (its position and its byte offset) and a bit or two per input line;
ids other than line numbers are held in a dict (as the reader's duplicate check holds them). The lines themselves are
read twice from the shard files: once to check them, once to copy them in order (heapq.merge over the shards; a
shard that is not in input order, after `--resume` or with `--unordered`, is read through its sorted offsets).
"""

from __future__ import annotations

import contextlib
import heapq
import os
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from nvcli.jobs import jsonio
from nvcli.jobs.reader import SeenIds
from nvcli.jobs.requests import id_key, line_key, read_line_id
from nvcli.jobs.resume import error_line_number, output_key

SHOWN = 5  # missing ids named per shard; the rest are counted


class MergeError(Exception):
    """The shards do not make one whole output (exit code 1), or a usage error (2); the message says what to do."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class MergeResult:
    lines: int = 0  # output lines written
    shards: int = 0
    torn: list[int] = field(default_factory=list)  # shards whose file ended in a torn line (left out)


class _Bits:
    """A growable bitset over 0-based positions."""

    def __init__(self) -> None:
        self.data = bytearray()

    def add(self, n: int) -> None:
        byte = n >> 3
        if byte >= len(self.data):
            self.data.extend(bytes(max(byte + 1 - len(self.data), len(self.data))))
        self.data[byte] |= 1 << (n & 7)

    def __contains__(self, n: int) -> bool:
        byte = n >> 3
        return byte < len(self.data) and bool(self.data[byte] >> (n & 7) & 1)

    def minus(self, other: _Bits) -> Iterator[int]:
        """The positions in self and not in other, in order."""
        for byte, bits in enumerate(self.data):
            rest = bits & ~(other.data[byte] if byte < len(other.data) else 0)
            while rest:
                low = rest & -rest
                yield byte * 8 + low.bit_length() - 1
                rest ^= low


class _InputIndex:
    """The input's non-blank lines, each under the key its shard's output line carries: its id as the shard job
    read it (an id shared with an earlier line of the same shard is that shard's duplicate_id error line, keyed by
    position; shards.py), so that output lines are placed by key alone."""

    def __init__(self, path: Path, count: int) -> None:
        self.count = count
        self.lines = _Bits()  # non-blank lines
        self.ids = SeenIds()  # id keys -> the first line that has each, across shards (the reader's duplicate check)
        self.by_line: dict[str, int] = {}  # line keys (lines answered by position) -> position
        self.shared: dict[str, dict[int, int]] = {}  # a key lines of different shards share -> shard -> position
        self.total = 0
        with open(path, "rb") as f:
            for p, raw in enumerate(f):
                if not raw.strip():
                    continue
                self.lines.add(p)
                self.total += 1
                rid = read_line_id(raw, p)
                if rid is None:
                    self.by_line[line_key(p)] = p
                    continue
                key = id_key(rid)
                first = self.ids.claim(rid, key, p)
                if first == p:
                    continue
                by_shard = self.shared.get(key, {first % count: first})
                if p % count in by_shard:  # the shard's own duplicate: its error line answers by position
                    self.by_line[line_key(p)] = p
                else:  # another shard's line has the key: both are answered under it, and merge refuses
                    by_shard[p % count] = p
                    self.shared[key] = by_shard

    def find(self, key: str) -> int | None:
        """The position of the line keyed `key` (merge refuses an input with shared keys first), or None."""
        if key.startswith("l:"):
            return self.by_line.get(key)
        return self.ids.owner(int(key[2:]) if key.startswith("i:") else key[2:], key)


@dataclass
class _Shard:
    index: int
    path: Path
    exists: bool
    positions: array = field(default_factory=lambda: array("q"))  # per kept line: its input position
    offsets: array = field(default_factory=lambda: array("q"))  # ... its byte offset in the file
    in_order: bool = True
    torn: bool = False

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """(position, raw line) in input order."""
        if not self.positions:
            return
        order: range | list[int] = range(len(self.positions))
        if not self.in_order:
            order = sorted(order, key=self.positions.__getitem__)
        with open(self.path, "rb") as f:  # seeks within the read buffer cost nothing: an ordered shard streams
            for i in order:
                f.seek(self.offsets[i])
                yield self.positions[i], f.readline()


def merge(out: str, shard_files: list[str], input_path: str | None = None) -> MergeResult:
    """Check the shards' outputs and write them to `out` (- for stdout) in input order; raise MergeError."""
    k = len(shard_files)
    if k == 0:
        raise MergeError("give the shards' output files, in shard-index order", 2)
    src = _check_paths(out, shard_files, input_path)
    index = _InputIndex(src, k) if src is not None else None
    shards = [_Shard(j, Path(p), Path(p).exists()) for j, p in enumerate(shard_files)]
    if index is not None and index.shared:
        key, by_shard = next(iter(index.shared.items()))
        lines = " and ".join(f"{p + 1} (shard {j})" for j, p in by_shard.items())
        more = f" ({len(index.shared) - 1} more ids are shared so)" if len(index.shared) > 1 else ""
        raise MergeError(f"duplicate id {key[2:] if key[0] == 'i' else repr(key[2:])}: input lines {lines} have "
                         f"it{more}; each shard answers its own line, where an unsharded job answers the later one "
                         "with a duplicate_id error line: ids must be unique across shards")
    seen = _Bits()
    claims = _Claims() if index is None else None
    for shard in shards:
        if shard.exists:
            _scan(shard, k, index, seen, claims, shards)
    if index is not None and src is not None:
        _check_missing(index, seen, shards, src, k)
    result = MergeResult(shards=k, torn=[s.index for s in shards if s.torn])
    merged = heapq.merge(*(s.lines() for s in shards))
    if out == "-":
        result.lines = _write(merged, sys.stdout.buffer)
        return result
    out_path = Path(out)
    tmp = out_path.with_name(f".{out_path.name}.nv-merge-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            result.lines = _write(merged, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)  # only a whole output takes OUT's place
    finally:
        tmp.unlink(missing_ok=True)
    return result


def _write(lines: Iterator[tuple[int, bytes]], dst: BinaryIO) -> int:
    n = 0
    for _, raw in lines:
        dst.write(raw)
        n += 1
    dst.flush()
    return n


def _check_paths(out: str, shard_files: list[str], input_path: str | None) -> Path | None:
    src = None
    if input_path is not None:
        src = Path(input_path)
        if not src.is_file():
            raise MergeError(f"--input: {input_path!r} is not a file (give the JSONL input the shards ran on)", 2)
    resolved: dict[Path, str] = {}
    for p in shard_files:
        path = Path(p)
        if path.is_dir():
            raise MergeError(f"shard file {p!r} is a directory", 2)
        if not path.exists() and src is None:
            raise MergeError(f"shard file {p!r} does not exist (with --input INPUT, nv merge names the lines it "
                             "lacks)", 2)
        if path.resolve() in resolved:
            raise MergeError(f"shard file {p!r} is given twice (also as {resolved[path.resolve()]!r})", 2)
        resolved[path.resolve()] = p
    if out != "-":
        out_path = Path(out)
        if out_path.is_dir():
            raise MergeError(f"output {out!r} is a directory", 2)
        if not out_path.parent.exists():
            raise MergeError(f"cannot write {out!r}: directory {str(out_path.parent)!r} does not exist", 2)
        if out_path.resolve() in resolved or (src is not None and out_path.resolve() == src.resolve()):
            raise MergeError(f"the output {out!r} is one of the files to merge; write to another file", 2)
    return src


class _Claims:
    """Without the input: which key each placed line has, so that one id answered at two positions (an explicit
    integer id and another line's line number, in different shards) is refused. Keys that are their line's own
    number are one bit; others are held in a dict."""

    def __init__(self) -> None:
        self.own = _Bits()  # position p answered under the id p + 1
        self.others: dict[str, int] = {}  # any other key -> the position answered under it

    def claim(self, key: str, p: int) -> int | None:
        """Take `key` for position p; None, or the other position that has it already."""
        if key == id_key(p + 1):
            self.own.add(p)
            return self.others.get(key)
        if key.startswith("i:"):
            n = int(key[2:]) - 1
            if n >= 0 and n != p and n in self.own:
                return n
        first = self.others.setdefault(key, p)
        return None if first == p else first


def _scan(shard: _Shard, k: int, index: _InputIndex | None, seen: _Bits, claims: _Claims | None,
          shards: list[_Shard]) -> None:
    """Place every line of one shard file; raise MergeError at the first that cannot be placed or is answered
    twice."""
    size = shard.path.stat().st_size
    name = f"shard file {str(shard.path)!r} (shard {shard.index})"
    last = -1
    with open(shard.path, "rb") as f:
        offset = 0
        for n, raw in enumerate(f, start=1):
            at, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                obj = jsonio.loads(raw)
                key, _ = output_key(obj)
            except (jsonio.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError):
                if offset == size:  # a torn last line (a killed job): left out, as --resume cuts it
                    shard.torn = True
                    break
                raise MergeError(f"{name}: line {n} is not an nv output line (JSON with an \"id\")") from None
            if not raw.endswith(b"\n"):  # whole JSON without its newline: still the last write of a killed job
                shard.torn = True
                break
            p = _position(obj, key, index, name, n)
            if p in seen:  # checked before the owner: a line copied into a second shard file is a duplicate
                raise MergeError(f"duplicate id {_show(obj['id'])}: {name} line {n} answers input line {p + 1}, "
                                 f"which {_locate(shards, p)} answers already; keep one")
            if p % k != shard.index:
                raise MergeError(
                    f"{name}: line {n} answers input line {p + 1} (id {_show(obj['id'])}), which shard {p % k} owns: "
                    f"give the {k} shard files in shard-index order (0 to {k - 1}; a shell glob puts 10 before 2)"
                    + ("" if index is not None else ", or --input INPUT where ids are integers of their own"))
            first = claims.claim(key, p) if claims is not None else None
            if first is not None:
                raise MergeError(f"duplicate id {_show(obj['id'])}: {name} line {n} answers it for input line "
                                 f"{p + 1}, and {_locate(shards, first)} for input line {first + 1}; ids must be "
                                 "unique across shards (where ids are integers of their own, give --input INPUT)")
            seen.add(p)
            shard.in_order = shard.in_order and p > last
            last = max(last, p)
            shard.positions.append(p)
            shard.offsets.append(at)


def _locate(shards: list[_Shard], p: int) -> str:
    """Which shard file and line answer input position p (for messages)."""
    for s in shards:
        for i, q in enumerate(s.positions):
            if q == p:
                with open(s.path, "rb") as f:
                    line = f.read(s.offsets[i]).count(b"\n") + 1
                return f"shard file {str(s.path)!r} line {line}"
    return "another line"


def _position(obj: dict, key: str, index: _InputIndex | None, name: str, n: int) -> int:
    """The 0-based input position output line n answers: by key from the input, else the line number it records."""
    if index is not None:
        p = index.find(key)
        if p is None:
            raise MergeError(f"{name}: line {n} answers id {_show(obj['id'])}, which no line of --input has: give "
                             "the input the shards ran on")
        return p
    line = error_line_number(obj)
    if line is not None:
        return line - 1
    rid = obj["id"]
    if type(rid) is int and rid >= 1:
        return rid - 1  # a line without an id has its line number as its id (requests.py)
    raise MergeError(f"{name}: line {n} has the id {_show(rid)}, which does not say its input line: give --input "
                     "INPUT (the input the shards ran on) to place lines by their ids")


def _check_missing(index: _InputIndex, seen: _Bits, shards: list[_Shard], src: Path, k: int) -> None:
    """Raise MergeError naming the input lines no shard answers (a few ids per shard, then a count) and the shard
    to run again with --resume."""
    missing: dict[int, list[int]] = {}  # shard -> its missing positions (the first SHOWN)
    counts = [0] * k
    for p in index.lines.minus(seen):
        counts[p % k] += 1
        if counts[p % k] <= SHOWN:
            missing.setdefault(p % k, []).append(p)
    total = sum(counts)
    if not total:
        return
    ids = _ids_at(src, {p for ps in missing.values() for p in ps})
    rows = []
    for j, ps in sorted(missing.items()):
        s = shards[j]
        shown = ", ".join(ids[p] for p in ps) + (f" and {counts[j] - len(ps)} more" if counts[j] > len(ps) else "")
        where = f"{str(s.path)!r}" + ("" if s.exists else ", which does not exist") + (", torn last line left out"
                                                                                         if s.torn else "")
        rows.append(f"  shard {j} ({where}) lacks {counts[j]}: {shown}")
    example = min(missing)
    raise MergeError(
        f"{total} of {index.total} input lines have no output line in the shards; nothing written\n"
        + "\n".join(rows) + "\n"
        f"  run each such shard again with --resume, e.g. nv generate {str(src)!r} -o {str(shards[example].path)!r} "
        f"--num-shards {k} --shard-index {example} --resume (and its other flags), then merge again")


def _ids_at(src: Path, positions: set[int]) -> dict[int, str]:
    """How the input lines at `positions` are named: "id N" where the id is the line number, else "id X (line N)",
    or "line N (no readable id)"."""
    names: dict[int, str] = {}
    last = max(positions)
    with open(src, "rb") as f:
        for p, raw in enumerate(f):
            if p in positions:
                rid = read_line_id(raw, p)
                names[p] = (f"line {p + 1} (no readable id)" if rid is None else f"id {p + 1}" if rid == p + 1
                            else f"id {_show(rid)} (line {p + 1})")
            if p >= last:
                break
    return names


def _show(rid: object) -> str:
    return repr(rid) if isinstance(rid, str) else str(rid)


def merge_command(out: str, shard_files: list[str], input_path: str | None = None, quiet: bool = False) -> int:
    """`nv merge`: the exit code (0 merged, 1 the shards do not make a whole output, 2 usage error); messages go to
    stderr."""
    try:
        result = merge(out, shard_files, input_path)
    except MergeError as e:
        _err(f"error: {e}")
        return e.exit_code
    except OSError as e:
        _err(f"error: {e.strerror or e}: {e.filename!r}" if e.filename else f"error: {e}")
        return 1
    if not quiet:
        torn = "".join(f"; shard {j}'s torn last line was left out" for j in result.torn)
        note = "" if input_path is not None else " (without --input, lines missing from the shards go unnoticed)"
        where = "stdout" if out == "-" else repr(out)
        _err(f"merged {result.lines:,} lines from {result.shards} shards into {where}{torn}{note}")
    return 0


def _err(msg: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"nv merge: {msg}\n")
        sys.stderr.flush()
