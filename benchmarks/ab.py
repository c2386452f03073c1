"""Two source trees side by side on one machine: the same benchmark cases, each tree running its own scripts.

    python3 benchmarks/ab.py --base DIR [--new DIR] [--cases throughput,fp8,latency,streaming,shared-prefix,startup]
        [--rounds 2] [--out FILE.json] [--logs DIR] [--timeout 600]

DIR is a tree made with `mkdir DIR && git archive <commit> | tar -x -C DIR`; --new defaults to this checkout. Every
round runs each case in the base tree, then in the new one, each run a fresh process with cwd and PYTHONPATH set to
its tree, so that machine drift hits both alike and each tree runs its own copy of the benchmark script. The rows a
run prints are read back (`parse_rows`): `## name: value ...` rows where there are any, else the last markdown
table's rows. The last table printed gives, per case and row, the median of each tree's values and new / base. A
run that fails prints its exit code and the tail of its log, and the harness goes on. Logs stay in --logs.
Each tree compiles its kernels into a Triton cache of its own (removed at the end), so that neither starts up on
what the other compiled: the first round's start-up rows are cold for both trees, later rounds' warm for both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    """One benchmark command, run from a tree's root: `python3 SCRIPT ARGS...`."""

    script: str
    args: tuple[str, ...] = ()
    cold_triton_cache: bool = False  # an empty TRITON_CACHE_DIR per run (a first start-up on a machine)


E2E = "benchmarks/gpu_e2e.py"
# Each takes about 30-90 s on an H100 (dummy Qwen3-0.6B weights; start-up included).
CASES: dict[str, Case] = {
    "throughput": Case(E2E, ("--sections", "throughput", "--repeats", "3")),
    "fp8": Case(E2E, ("--sections", "fp8", "--repeats", "3")),
    "latency": Case(E2E, ("--sections", "latency")),
    "streaming": Case(E2E, ("--sections", "streaming")),
    "streaming-fp8": Case(E2E, ("--sections", "streaming-fp8")),
    "sampling": Case(E2E, ("--sections", "sampling", "--sampling-rows", "as-is,qwen3,logprobs1", "--repeats", "2")),
    "structured": Case(E2E, ("--sections", "structured", "--repeats", "2")),
    "shared-prefix": Case("benchmarks/shared_prefix_gpu.py", ("--sections", "stream")),
    "shared-prefix-fp8": Case("benchmarks/shared_prefix_gpu.py", ("--sections", "stream", "--kv-cache-dtype", "fp8")),
    "scoring": Case("benchmarks/prompt_heavy.py", ("--kinds", "engine,echo,score", "--lines", "768", "--max-tokens",
                                                   "1", "--repeats", "2", "--prompt-logprobs", "0")),
    "startup": Case("benchmarks/startup.py", cold_triton_cache=True),
}
DEFAULT_CASES = "throughput,fp8,latency,streaming,shared-prefix,startup"

_NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?"
_ROW = re.compile(rf"^## (?P<name>.+):\s+(?P<value>{_NUMBER})(?P<rest>.*)$")  # the last `: <number>`
_BARE_ROW = re.compile(rf"^## (?P<name>[^:]+?)\s+(?P<value>{_NUMBER})(?P<rest>.*)$")  # `## imports 2.4 s (...)`
_FAILED_ROW = re.compile(r"^## (?P<name>.+?): FAILED")
_LEADING_NUMBER = re.compile(rf"^(?P<value>{_NUMBER})(?P<rest>.*)$")
_PARENTHESES = re.compile(r"\s*\([^()]*\)")
_SEPARATOR = re.compile(r"^:?-{3,}:?$")


@dataclass
class Row:
    name: str
    value: float
    unit: str


@dataclass
class Run:
    case: str
    tree: str  # "base" or "new"
    round: int
    rc: int  # 124: killed at the timeout; -1: the tree lacks the script
    seconds: float
    log: str
    rows: list[Row] = field(default_factory=list)
    failed_rows: list[str] = field(default_factory=list)  # `## name: FAILED` rows of a run that exited 0


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _unit(rest: str) -> str:
    """The words after a value up to the first comma, semicolon or parenthesis: `output tok/s`, `ms/token`, `s`."""
    return re.split(r"[,;(]", rest, maxsplit=1)[0].strip()


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_rows(text: str) -> tuple[list[Row], list[str]]:
    """(rows, names of failed sections) of one run's output.

    `## name: value unit, ...` rows, if the output has any: the value is the number after the line's last colon that
    a number follows (names hold colons: `sampling: 64 prompts x n=4: 29,040 output tok/s`), parenthesized parts of the name are dropped (they carry counts that may differ between trees), rows whose value
    is not a number (`## device: ...`) are skipped and `## name: FAILED ...` rows are returned apart. Otherwise the
    rows of the last markdown table: the cells before its first cell that starts with a number make the name (joined
    by ": "), that cell the value, and the unit is the cell's words after the number or else its column's header."""
    lines = text.splitlines()
    rows: list[Row] = []
    failed: list[str] = []
    for line in lines:
        if not line.startswith("## "):
            continue
        if m := _FAILED_ROW.match(line):
            failed.append(m["name"])
        elif m := _ROW.match(line) or (None if ": " in line else _BARE_ROW.match(line)):
            name = _PARENTHESES.sub("", m["name"]).strip()
            rows.append(Row(name, _number(m["value"]), _unit(m["rest"])))
    if rows or failed:
        return rows, failed
    separators = [i for i, line in enumerate(lines)
                  if line.startswith("|") and all(_SEPARATOR.match(c) for c in _cells(line))]
    if not separators:
        return [], []
    header = _cells(lines[separators[-1] - 1]) if separators[-1] > 0 else []
    for line in lines[separators[-1] + 1:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        for i, cell in enumerate(cells[1:], start=1):
            if m := _LEADING_NUMBER.match(cell):
                unit = _unit(m["rest"]) or (header[i] if i < len(header) else "")
                rows.append(Row(": ".join(cells[:i]), _number(m["value"]), unit))
                break
    return rows, []


def run_case(name: str, case: Case, tree: Path, label: str, round_: int, logs: Path, timeout_s: float,
             triton_cache: Path | None = None) -> Run:
    """One run of `case` from `tree`, a fresh process group with cwd and PYTHONPATH at the tree and Triton's cache
    in `triton_cache` (an empty one for a cold case); its output goes to a log in `logs`, its rows are parsed from
    there."""
    log = logs / f"{name}_{label}_{round_}.log"
    script = tree / case.script
    if not script.is_file():
        log.write_text(f"{script} does not exist\n")
        return Run(name, label, round_, -1, 0.0, str(log))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    cache = tempfile.mkdtemp(prefix="ab-triton-") if case.cold_triton_cache else None
    if cache or triton_cache:
        env["TRITON_CACHE_DIR"] = str(cache or triton_cache)
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, case.script, *case.args], cwd=tree, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = 124
        # the run's own group (compile and TP workers included): nothing of it may outlive the run
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    rows, failed = parse_rows(log.read_text(errors="replace"))
    return Run(name, label, round_, rc, time.perf_counter() - t0, str(log), rows, failed)


def log_tail(path: str, lines: int = 20) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def summarize(runs: list[Run]) -> list[dict]:
    """Per (case, row), in order of first appearance: each tree's values, their medians and new / base."""
    table: dict[tuple[str, str], dict] = {}
    for run in runs:
        for row in run.rows:
            entry = table.setdefault((run.case, row.name), {"case": run.case, "row": row.name, "unit": row.unit,
                                                            "base": [], "new": []})
            entry[run.tree].append(row.value)
    for entry in table.values():
        base, new = (statistics.median(entry[t]) if entry[t] else None for t in ("base", "new"))
        entry["base_median"], entry["new_median"] = base, new
        entry["ratio"] = new / base if base and new is not None else None
    return list(table.values())


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.3f}"
    return f"{text} {unit}".strip()


def format_table(summary: list[dict]) -> str:
    lines = ["| case | row | base median | new median | new/base |", "| --- | --- | --- | --- | --- |"]
    for e in summary:
        ratio = "-" if e["ratio"] is None else f"{e['ratio']:.3f}"
        lines.append(f"| {e['case']} | {e['row']} | {_fmt(e['base_median'], e['unit'])} | "
                     f"{_fmt(e['new_median'], e['unit'])} | {ratio} |")
    return "\n".join(lines)


def run_ab(base: Path, new: Path, cases: dict[str, Case], rounds: int, logs: Path, timeout_s: float = 600.0
           ) -> tuple[list[Run], list[dict]]:
    """Every round, every case: the base tree, then the new one, each with its own Triton cache. Returns the runs
    and `summarize` of them."""
    runs = []
    caches = Path(tempfile.mkdtemp(prefix="ab-triton-"))
    try:
        for round_ in range(1, rounds + 1):
            for name, case in cases.items():
                for label, tree in (("base", base), ("new", new)):
                    runs.append(_run_and_report(name, case, tree, label, round_, rounds, logs, timeout_s,
                                                caches / label))
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    return runs, summarize(runs)


def _run_and_report(name: str, case: Case, tree: Path, label: str, round_: int, rounds: int, logs: Path,
                    timeout_s: float, triton_cache: Path) -> Run:
    run = run_case(name, case, tree, label, round_, logs, timeout_s, triton_cache)
    print(f"[round {round_}/{rounds}] {name} {label}: exit {run.rc} in {run.seconds:.0f} s, {len(run.rows)} rows",
          flush=True)
    if run.rc != 0 or run.failed_rows:
        failed = f" (failed sections: {', '.join(run.failed_rows)})" if run.failed_rows else ""
        print(f"  {name} {label} exit code {run.rc}{failed}; log {run.log}, its tail:", flush=True)
        print("  | " + log_tail(run.log).replace("\n", "\n  | "), flush=True)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the baseline tree (git archive of a commit)")
    ap.add_argument("--new", default=REPO, type=Path, help="the tree under test (default: this checkout)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the runs and the summary as JSON")
    ap.add_argument("--logs", type=Path, default=None, help="where each run's log goes (default: a new temp dir)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is killed (exit 124)")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    for tree in (args.base, args.new):
        if not tree.is_dir():
            ap.error(f"{tree} is not a directory")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="ab-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    base, new = args.base.resolve(), args.new.resolve()
    print(f"base {base}\nnew  {new}\nlogs {logs}", flush=True)
    runs, summary = run_ab(base, new, {c: CASES[c] for c in names}, args.rounds, logs, args.timeout)
    failures = [r for r in runs if r.rc != 0 or r.failed_rows]
    print()
    print(format_table(summary))
    if failures:
        print(f"\n{len(failures)} failed run(s): "
              + ", ".join(f"{r.case} {r.tree} round {r.round} (exit {r.rc})" for r in failures))
    if args.out:
        args.out.write_text(json.dumps({"base": str(base), "new": str(new), "summary": summary,
                                        "runs": [r.__dict__ | {"rows": [row.__dict__ for row in r.rows]}
                                                 for r in runs]}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
