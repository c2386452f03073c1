"""Print what `nv generate`'s live dashboard and summary look like, as plain text.

    python examples/dashboard_capture.py                 # made-up numbers, no model needed
    python examples/dashboard_capture.py --model DIR     # a short real job (add --device cpu etc.)

The dashboard is drawn on a recording Rich console (as a terminal would show it) and exported
as text, which is what gets pasted into notes and reviews.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console

from nvcli.dashboard import LiveDashboard, Rates, render_dashboard, render_summary
from nvcli.engine.protocol import EngineStats
from nvcli.jobs.reader import ReaderCounts
from nvcli.jobs.runner import JobProgress, JobResult


def demo_stats() -> EngineStats:
    return EngineStats(num_running=256, num_waiting=250, num_preemptions=3, kv_blocks_total=4096, kv_blocks_used=3277,
                       prefix_cache_hit_tokens=4321, prefix_cache_query_tokens=10000, prompt_tokens=420_000,
                       generation_tokens=160_000, num_steps=4567, last_step_time_s=0.0123, num_finished=1234)


def recording_console(width: int) -> Console:
    return Console(record=True, force_terminal=True, width=width, file=io.StringIO())


def demo(width: int) -> str:
    progress = JobProgress(elapsed_s=83.0, written=1234, failed=4, skipped=0, read=1800, in_flight=512, buffered=3,
                           total=10000, prompt_tokens=400_000, completion_tokens=150_000, stats=demo_stats(),
                           model_name="Qwen/Qwen3-0.6B")
    history = (900.0, 2100, 3300, 3900, 4200, 4400, 4350, 4500, 4610, 4480, 4550, 4567, 4590, 4620, 4567)
    rates = Rates(prompt_tps=12345.6, gen_tps=4567.8, lines_ps=14.5, history=history)
    result = JobResult(written=1234, errors=Counter({"prompt_too_long": 3, "invalid_json": 1}),
                       counts=ReaderCounts(lines=1236, blank=2, outputs=1234), prompt_tokens=400_000,
                       completion_tokens=150_000, elapsed_s=83.0, stats=demo_stats())
    console = recording_console(width)
    console.print(render_dashboard(progress, rates, width=width))
    console.print(render_summary(result))
    return console.export_text()


class FrameRecorder(LiveDashboard):
    """Keeps every frame's inputs, to show one from the middle of the run afterwards."""

    def __init__(self, console: Console) -> None:
        super().__init__(console)
        self.frames: list[tuple[JobProgress, Rates]] = []

    def update(self, p: JobProgress) -> None:
        super().update(p)
        assert self.last is not None
        self.frames.append(self.last)


def real(model: str, device: str, width: int) -> str:
    import tempfile

    from nvcli.config import EngineConfig
    from nvcli.engine.llm_engine import LLMEngine
    from nvcli.jobs import Defaults, JobOptions, run_job
    from nvcli.jobs.runner import LineCounter

    engine = LLMEngine(EngineConfig(model=model, device=device, num_kvcache_blocks=256, max_model_len=512,
                                    max_num_seqs=8))
    preamble = "You are a careful assistant. Answer the question below with one number and nothing else. " * 2
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i in range(48):
            f.write(f'{{"prompt": "{preamble}Question {i}: what is {i} plus {i}?", "max_tokens": {8 + i % 8}}}\n')
    counter = LineCounter(f.name)
    counter.start()
    counter.join()
    dash = FrameRecorder(recording_console(width))
    opts = JobOptions(defaults=Defaults(sampling={"temperature": 0, "ignore_eos": True}), model_name=Path(model).name)
    with open(f.name, "rb") as src:
        result = run_job(engine, src, io.BytesIO(), opts, reporter=dash, counter=counter)
    engine.shutdown()
    Path(f.name).unlink()
    mid = [fr for fr in dash.frames if fr[0].written > 0 and fr[0].in_flight > 0] or dash.frames
    busiest = mid[len(mid) // 2]  # a frame from the middle of the run
    console = recording_console(width)
    console.print(render_dashboard(*busiest, width=width))
    console.print(render_summary(result))
    return console.export_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="run a short real job with this model instead of made-up numbers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=100)
    a = ap.parse_args()
    sys.stdout.write(real(a.model, a.device, a.width) if a.model else demo(a.width))


if __name__ == "__main__":
    main()
