"""What `nv generate` shows on stderr: a Rich Live dashboard on a terminal, one plain progress
line every few seconds elsewhere, and a summary table at the end. stdout never sees any of it.

The renderers are pure functions of a `JobProgress` snapshot plus rolling rates, so tests
render them on a recording console with made-up numbers.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import IO

from rich.console import Console, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from nvcli.engine.protocol import EngineStats
from nvcli.jobs.runner import JobProgress, JobResult

SPARK = "▁▂▃▄▅▆▇█"


# -- rolling rates ---------------------------------------------------------------------------
@dataclass
class Rates:
    prompt_tps: float = 0.0  # prompt tokens/s over the last few seconds
    gen_tps: float = 0.0  # generated tokens/s over the last few seconds
    lines_ps: float = 0.0  # output lines/s over the last half minute
    history: tuple[float, ...] = ()  # generated tokens/s, one value per second, oldest first
    replica_gen_tps: tuple[float | None, ...] = ()  # data parallelism: each replica's (None: gone or not heard from)


class RateTracker:
    """Rolling throughput from cumulative counters sampled over time."""

    def __init__(self, window_s: float = 5.0, lines_window_s: float = 30.0, history: int = 60) -> None:
        self.window_s = window_s
        self.lines_window_s = lines_window_s
        self.samples: deque[tuple[float, int, int, int]] = deque()  # (t, prompt, gen, lines)
        self.history: deque[float] = deque(maxlen=history)
        self._bucket_t: float | None = None
        self._bucket_gen = 0

    def add(self, t: float, prompt_tokens: int, gen_tokens: int, lines: int) -> Rates:
        self.samples.append((t, prompt_tokens, gen_tokens, lines))
        horizon = max(self.window_s, self.lines_window_s)
        while len(self.samples) > 2 and t - self.samples[1][0] >= horizon:
            self.samples.popleft()
        if self._bucket_t is None:
            self._bucket_t, self._bucket_gen = t, gen_tokens
        while t - self._bucket_t >= 1.0:  # one sparkline value per elapsed second
            self.history.append(max(0.0, (gen_tokens - self._bucket_gen) / (t - self._bucket_t)))
            self._bucket_t, self._bucket_gen = t, gen_tokens
        return Rates(
            prompt_tps=self._rate(t, 1, self.window_s),
            gen_tps=self._rate(t, 2, self.window_s),
            lines_ps=self._rate(t, 3, self.lines_window_s),
            history=tuple(self.history),
        )

    def _rate(self, t: float, i: int, window: float) -> float:
        old = next((s for s in self.samples if t - s[0] <= window), self.samples[0])
        new = self.samples[-1]
        dt = new[0] - old[0]
        return max(0.0, (new[i] - old[i]) / dt) if dt > 0 else 0.0


def with_replica_rates(rates: Rates, trackers: list[RateTracker], p: JobProgress, t: float) -> Rates:
    """`rates` with each data-parallel replica's generation rate, from its own counters (`trackers`, one per
    replica, kept by the caller)."""
    replicas = p.stats.replicas if p.stats is not None else None
    if not replicas:
        return rates
    while len(trackers) < len(replicas):
        trackers.append(RateTracker(history=0))
    gen = tuple(None if s is None else tracker.add(t, s.prompt_tokens, s.generation_tokens, s.num_finished).gen_tps
                for tracker, s in zip(trackers, replicas))
    return dataclasses.replace(rates, replica_gen_tps=gen)


def engine_tokens(p: JobProgress) -> tuple[int, int]:
    """Cumulative (prompt, generated) tokens: live engine counters when there are any."""
    s = p.stats
    if s is not None:
        return int(s.prompt_tokens), int(s.generation_tokens)
    return p.prompt_tokens, p.completion_tokens


# -- formatting helpers ----------------------------------------------------------------------
def sparkline(values: tuple[float, ...] | list[float], width: int = 40) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    top = max(vals)
    if top <= 0:
        return SPARK[0] * len(vals)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in vals)


def fmt_duration(s: float | None) -> str:
    if s is None or s != s or s == float("inf"):
        return "--"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:,.1f}"


def job_rates(p: JobProgress, rates: Rates) -> Rates:
    """The rates over the whole job so far (its last frame): the rolling ones read 0 for prompts once the last prompt
    was computed more than a window ago."""
    prompt, gen = engine_tokens(p)
    if p.elapsed_s <= 0:
        return rates
    return Rates(prompt_tps=prompt / p.elapsed_s, gen_tps=gen / p.elapsed_s, lines_ps=p.written / p.elapsed_s,
                 history=rates.history, replica_gen_tps=rates.replica_gen_tps)


def eta_s(p: JobProgress, rates: Rates) -> float | None:
    if p.total is None or rates.lines_ps <= 0:
        return None
    return max(0, p.total - p.done) / rates.lines_ps


def hit_rate(stats: EngineStats) -> float | None:
    q = stats.prefix_cache_query_tokens
    return stats.prefix_cache_hit_tokens / q if q else None


def spec_decode(stats: EngineStats) -> str | None:
    """Speculative decoding's drafts as accepted so far; None where the engine has verified none (speculation off)."""
    rows, drafted, accepted = stats.spec_verify_rows, stats.spec_draft_tokens, stats.spec_accepted_tokens
    if not rows:
        return None
    return (f"accepted {accepted:,} / {drafted:,} drafts ({accepted / max(1, drafted):.0%}), "
            f"{1 + accepted / rows:.2f} tokens per verify")


# -- the live view ---------------------------------------------------------------------------
def _bar(total: int, completed: int, label: Text, width: int, **style: str) -> Table:
    row = Table.grid(padding=(0, 1))
    row.add_column(width=width, no_wrap=True)
    row.add_column(no_wrap=True, overflow="ellipsis")
    row.add_row(ProgressBar(total=total, completed=completed, width=width, **style), label)
    return row


def render_dashboard(p: JobProgress, rates: Rates, width: int = 100) -> RenderableType:
    bar_w = max(10, min(40, width - 60))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()

    # requests
    if p.total:
        frac = min(1.0, p.done / p.total)
        req = Text.assemble(
            (f"{p.done:,} / {p.total:,}", "bold"), f"  {frac:.0%}  ETA {fmt_duration(eta_s(p, rates))}"
        )
        grid.add_row("requests", _bar(p.total, p.done, req, bar_w))
    else:
        grid.add_row("requests", Text.assemble((f"{p.done:,}", "bold"), " done (total unknown: reading a stream)"))
    detail = f"ok {p.written - p.failed:,}   failed {p.failed:,}   in flight {p.in_flight:,}"
    if p.skipped:
        detail += f"   resumed past {p.skipped:,}"
    if p.buffered:
        detail += f"   reorder buffer {p.buffered:,}"
    grid.add_row("", Text(detail, style="red" if p.failed else ""))

    # throughput
    grid.add_row(
        "tokens/s",
        Text.assemble("prompt ", (fmt_num(rates.prompt_tps), "bold"), "   generation ", (fmt_num(rates.gen_tps), "bold green"),
                      f"   requests/s {rates.lines_ps:.2f}"),
    )
    spark = sparkline(rates.history, width=bar_w + 20)
    grid.add_row("gen tok/s", Text(spark or "(collecting)", style="green") + Text(
        f"  peak {fmt_num(max(rates.history))}" if rates.history else "", style="dim"))

    s = p.stats
    if s is not None:
        total = s.kv_blocks_total
        used = s.kv_blocks_used
        if total:
            kv = Text(f"{used:,} / {total:,} blocks used ({used / total:.0%}), {total - used:,} free")
            grid.add_row("KV cache", _bar(total, used, kv, bar_w, complete_style="magenta", finished_style="red"))
        hr = hit_rate(s)
        grid.add_row("prefix cache", f"hit rate {hr:.1%}" if hr is not None else "hit rate --")
        grid.add_row(
            "scheduler",
            f"running {s.num_running:,}   waiting {s.num_waiting:,}   "
            f"preempted {s.num_preemptions:,}",
        )
        spec = spec_decode(s)
        if spec is not None:
            grid.add_row("spec decode", spec)
        for i, r in enumerate(s.replicas or ()):
            grid.add_row(f"replica {i}", _replica_line(r, rates.replica_gen_tps[i] if i < len(rates.replica_gen_tps)
                                                       else None))
        step_ms = s.last_step_time_s * 1000
        grid.add_row("step", f"{step_ms:.1f} ms   steps {s.num_steps:,}   elapsed {fmt_duration(p.elapsed_s)}")
    else:
        grid.add_row("elapsed", fmt_duration(p.elapsed_s))
    title = f"nv generate · {p.model_name}" if p.model_name else "nv generate"
    subtitle = "draining: Ctrl-C again to abort" if p.draining else "Ctrl-C to stop"
    return Panel(grid, title=title, subtitle=subtitle, title_align="left", subtitle_align="right", width=width)


def _replica_line(s: EngineStats | None, gen_tps: float | None) -> Text:
    if s is None:
        return Text("gone (its lines went to the other replicas)", style="red")
    kv = f"KV {s.kv_blocks_used / s.kv_blocks_total:.0%}" if s.kv_blocks_total else "KV --"
    rate = "--" if gen_tps is None else fmt_num(gen_tps)
    return Text.assemble("gen ", (rate, "green"), f" tok/s   {kv}   running {s.num_running:,}   waiting "
                         f"{s.num_waiting:,}   done {s.num_finished:,}")


def plain_line(p: JobProgress, rates: Rates) -> str:
    """One progress line for stderr when it is not a terminal."""
    if p.total:
        head = f"{p.done}/{p.total} lines ({p.done / p.total:.0%})"
    else:
        head = f"{p.done} lines"
    parts = [head, f"failed {p.failed}", f"prompt {rates.prompt_tps:.0f} tok/s",
             f"gen {rates.gen_tps:.0f} tok/s"]
    s = p.stats
    if s is not None:
        total = s.kv_blocks_total
        if total:
            parts.append(f"KV {s.kv_blocks_used / total:.0%}")
        parts.append(f"running {s.num_running} waiting {s.num_waiting}")
        if s.spec_verify_rows:
            parts.append(f"spec accepted {s.spec_accepted_tokens}/{s.spec_draft_tokens}")
        if s.replicas:
            parts.append("replicas " + " ".join(
                "gone" if r is None else f"{rate or 0:.0f}tok/s,KV{r.kv_blocks_used / max(1, r.kv_blocks_total):.0%}"
                for r, rate in zip(s.replicas, rates.replica_gen_tps or (None,) * len(s.replicas))))
    parts.append(f"elapsed {fmt_duration(p.elapsed_s)}")
    if p.total:
        parts.append(f"ETA {fmt_duration(eta_s(p, rates))}")
    if p.draining:
        parts.append("draining")
    return "nv: " + " | ".join(parts)


# -- the summary -----------------------------------------------------------------------------
def render_summary(r: JobResult) -> Table:
    t = Table(title="nv generate: summary", show_header=False, title_justify="left", min_width=44)
    t.add_column(style="bold")
    t.add_column(justify="right")
    c = r.counts
    t.add_row("output lines written", f"{r.written:,}")
    t.add_row("  succeeded", f"{r.succeeded:,}")
    t.add_row("  failed", Text(f"{r.failed:,}", style="red" if r.failed else ""))
    for kind, n in sorted(r.errors.items()):
        t.add_row(f"    {kind}", Text(f"{n:,}", style="red"))
    if c.skipped:
        t.add_row("already answered (--resume)", f"{c.skipped:,}" + (f" ({c.skipped_errors} errors)" if c.skipped_errors else ""))
    if c.blank:
        t.add_row("blank lines skipped", f"{c.blank:,}")
    t.add_row("prompt tokens", f"{r.prompt_tokens:,}")
    t.add_row("generated tokens", f"{r.completion_tokens:,}")
    t.add_row("elapsed", f"{r.elapsed_s:.2f} s")
    if r.elapsed_s > 0:
        t.add_row("requests/s", f"{r.succeeded / r.elapsed_s:,.2f}")
        t.add_row("output tokens/s", f"{r.completion_tokens / r.elapsed_s:,.1f}")
        t.add_row("total tokens/s", f"{(r.prompt_tokens + r.completion_tokens) / r.elapsed_s:,.1f}")
    s = r.stats
    if s is not None:
        hr = hit_rate(s)
        if hr is not None:
            t.add_row("prefix cache hit rate", f"{hr:.1%}")
        t.add_row("preemptions", f"{s.num_preemptions:,}")
        spec = spec_decode(s)
        if spec is not None:
            t.add_row("speculative decoding", spec)
    if r.output_closed:
        t.add_row("stopped", "the output was closed")
    elif r.aborted:
        t.add_row("stopped", "aborted (Ctrl-C twice)")
    elif r.interrupted:
        how = "terminated (SIGTERM)" if r.terminated else "interrupted (Ctrl-C)"
        t.add_row("stopped", f"{how} after the last line was read: every line is answered" if r.answered_all
                  else f"{how}: rerun with --resume to finish")
    return t


# -- reporters (what the job loop talks to) ---------------------------------------------------
class LiveDashboard:
    """Rich Live view on stderr; refreshed by the job loop (no background thread)."""

    def __init__(self, console: Console | None = None, refresh_s: float = 0.25) -> None:
        self.console = console or Console(stderr=True)
        self.refresh_s = refresh_s
        self.tracker = RateTracker()
        self.replica_trackers: list[RateTracker] = []
        self.live: Live | None = None
        self.last: tuple[JobProgress, Rates] | None = None  # the latest frame's inputs

    def start(self, message: str = "starting") -> None:
        # the job starts from zero: tokens of a first step that admits every prompt count towards the rate
        self.tracker.add(time.monotonic(), 0, 0, 0)
        self.live = Live(Text(message), console=self.console, auto_refresh=False, redirect_stdout=False,
                         redirect_stderr=True, transient=False)
        self.live.start(refresh=True)

    def update(self, p: JobProgress) -> None:
        prompt, gen = engine_tokens(p)
        now = time.monotonic()
        rates = with_replica_rates(self.tracker.add(now, prompt, gen, p.written), self.replica_trackers, p, now)
        self.last = (p, rates)
        if self.live is not None:
            self.live.update(render_dashboard(p, rates, width=min(100, self.console.width)), refresh=True)

    def log(self, message: str) -> None:
        self.console.print(f"[yellow]nv:[/] {message}", highlight=False)

    def stop(self) -> None:
        if self.live is not None:
            if self.last is not None:  # the frame left on screen: the whole job's rates, as the summary counts them
                p, rates = self.last
                self.live.update(render_dashboard(p, job_rates(p, rates), width=min(100, self.console.width)),
                                 refresh=True)
            self.live.stop()
            self.live = None

    def summary(self, r: JobResult) -> None:
        self.console.print(render_summary(r))


class PlainProgress:
    """One line every `interval_s` seconds, for logs and CI (stderr is not a terminal)."""

    def __init__(self, stream: IO[str] | None = None, interval_s: float = 5.0, name: str = "nv") -> None:
        self.stream = stream or sys.stderr
        self.name = name  # what its lines start with
        self.interval_s = interval_s
        self.tracker = RateTracker()
        self.replica_trackers: list[RateTracker] = []
        self._last: float | None = None

    def start(self, message: str = "starting") -> None:
        self._write(f"{self.name}: {message}")
        self._last = time.monotonic()
        self.tracker.add(self._last, 0, 0, 0)  # the job starts from zero (see LiveDashboard.start)

    def update(self, p: JobProgress) -> None:
        now = time.monotonic()
        prompt, gen = engine_tokens(p)
        rates = with_replica_rates(self.tracker.add(now, prompt, gen, p.written), self.replica_trackers, p, now)
        if self._last is None or now - self._last >= self.interval_s:
            self._last = now
            self._write(plain_line(p, rates))

    def log(self, message: str) -> None:
        self._write(f"{self.name}: {message}")

    def stop(self) -> None:
        pass

    def summary(self, r: JobResult) -> None:
        console = Console(file=self.stream, width=100, no_color=True, highlight=False)
        console.print(render_summary(r))

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass
