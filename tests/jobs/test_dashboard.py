from __future__ import annotations

import io
from collections import Counter

from fake_engine import engine_stats
from rich.console import Console

from nvcli.dashboard import (
    LiveDashboard,
    PlainProgress,
    Rates,
    RateTracker,
    plain_line,
    render_dashboard,
    render_summary,
    sparkline,
)
from nvcli.jobs.reader import ReaderCounts
from nvcli.jobs.runner import JobProgress, JobResult


def progress(**kw) -> JobProgress:
    base = dict(elapsed_s=83.0, written=1234, failed=4, skipped=0, read=1800, in_flight=512, buffered=3, total=10000,
                prompt_tokens=400_000, completion_tokens=150_000, model_name="Qwen3-0.6B",
                stats=engine_stats(num_running=256, num_waiting=250, num_preemptions=3, kv_blocks_total=4096,
                                kv_blocks_used=3277, prefix_cache_hit_tokens=4321, prefix_cache_query_tokens=10000,
                                prompt_tokens=420_000, generation_tokens=160_000, num_steps=4567,
                                last_step_time_s=0.0123))
    base.update(kw)
    return JobProgress(**base)


RATES = Rates(prompt_tps=12345.6, gen_tps=4567.8, lines_ps=14.5,
              history=tuple(float(x) for x in [100, 800, 1500, 2600, 3900, 4500, 4400, 4600, 4567]))


def capture(renderable, width: int = 100) -> str:
    console = Console(record=True, force_terminal=True, width=width, file=io.StringIO(), color_system="truecolor")
    console.print(renderable)
    return console.export_text()


def test_dashboard_shows_throughput_kv_bar_and_counts():
    text = capture(render_dashboard(progress(), RATES))
    assert "1,234 / 10,000" in text and "ETA" in text
    assert "12,346" in text and "4,568" in text  # prompt and generation tok/s
    assert "▁" in text and "█" in text  # the sparkline
    assert "KV cache" in text and "3,277 / 4,096 blocks" in text and "80%" in text
    assert "━" in text  # the bars
    assert "hit rate 43.2%" in text
    assert "running 256" in text and "waiting 250" in text and "preempted 3" in text
    assert "12.3 ms" in text


def test_dashboard_for_a_pipe_has_no_total():
    text = capture(render_dashboard(progress(total=None), RATES))
    assert "total unknown" in text and "ETA" not in text


def test_plain_line_and_sparkline():
    line = plain_line(progress(), RATES)
    assert line.startswith("nv: 1234/10000 lines") and "gen 4568 tok/s" in line and "KV 80%" in line
    assert "\x1b" not in line
    assert sparkline([0, 1, 2, 3]) == "▁▃▆█" and sparkline([]) == "" and sparkline([0, 0]) == "▁▁"


def test_rate_tracker_rolls():
    t = RateTracker(window_s=2.0)
    r = Rates()
    for i in range(11):
        r = t.add(i * 0.5, prompt_tokens=i * 100, gen_tokens=i * 50, lines=i)
    assert abs(r.gen_tps - 100) < 1e-6 and abs(r.prompt_tps - 200) < 1e-6 and abs(r.lines_ps - 2) < 1e-6
    assert len(r.history) == 5 and abs(r.history[-1] - 100) < 1e-6


def test_summary_table():
    res = JobResult(written=10, errors=Counter({"invalid_json": 1, "prompt_too_long": 2}),
                    counts=ReaderCounts(lines=12, blank=2, outputs=10), prompt_tokens=1000, completion_tokens=500,
                    elapsed_s=2.0, stats=engine_stats(prefix_cache_hit_tokens=1, prefix_cache_query_tokens=4))
    text = capture(render_summary(res))
    assert "succeeded" in text and "invalid_json" in text and "prompt_too_long" in text
    assert "output tokens/s" in text and "250.0" in text and "25.0%" in text


def test_reporters_write_to_their_stream_only():
    buf = io.StringIO()
    p = PlainProgress(buf, interval_s=0.0)
    p.start()
    p.update(progress())
    p.log("hello")
    assert "nv: 1234/10000 lines" in buf.getvalue() and "nv: hello" in buf.getvalue()
    console = Console(record=True, force_terminal=True, width=100, file=io.StringIO())
    d = LiveDashboard(console)
    d.start()
    d.update(progress())
    d.stop()
    assert "KV cache" in console.export_text()


def test_prompts_admitted_in_the_first_step_show_in_the_prompt_rate(monkeypatch):
    """200 prompts of 2,030 tokens all computed in one step before the first frame: the rate counts them from the
    job's start (it read 0.0 while the summary counted 2,030), and the last frame shows the job's averages."""
    clock = [100.0]
    monkeypatch.setattr("nvcli.dashboard.time.monotonic", lambda: clock[0])
    stats = engine_stats(prompt_tokens=2030, generation_tokens=200)
    buf = io.StringIO()
    plain = PlainProgress(buf, interval_s=0.0)
    plain.start()
    clock[0] = 102.0
    plain.update(progress(elapsed_s=2.0, stats=stats))
    assert "prompt 1015 tok/s" in buf.getvalue()

    clock[0] = 100.0
    console = Console(record=True, force_terminal=True, width=100, file=io.StringIO())
    live = LiveDashboard(console)
    live.start()
    clock[0] = 102.0
    live.update(progress(elapsed_s=2.0, stats=stats))
    assert live.last is not None and live.last[1].prompt_tps == 1015
    clock[0] = 120.0  # 18 s of decoding later the rolling prompt rate is 0; the last frame is the job's
    live.update(progress(elapsed_s=20.0, stats=engine_stats(prompt_tokens=2030, generation_tokens=4000)))
    assert live.last[1].prompt_tps == 0
    live.stop()
    assert "prompt 102   generation 200" in console.export_text()  # 2,030 and 4,000 tokens over 20 s


def test_an_interrupt_after_every_line_was_read_offers_no_resume():
    """Ctrl-C while the last lines were in flight: they were finished and written, nothing is left to resume."""
    done = JobResult(written=3, counts=ReaderCounts(lines=3, outputs=3, exhausted=True), interrupted=True)
    text = capture(render_summary(done))
    assert "interrupted (Ctrl-C) after the last line was read: every line is answered" in text and "--resume" not in text
    cut = JobResult(written=2, counts=ReaderCounts(lines=3, outputs=2), interrupted=True)
    assert "rerun with --resume to finish" in capture(render_summary(cut))
    aborted = JobResult(written=2, counts=ReaderCounts(lines=3, outputs=3, exhausted=True), interrupted=True,
                        aborted=True)
    assert "aborted" in capture(render_summary(aborted))


def test_each_data_parallel_replica_shows_its_rate_kv_and_queue(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("nvcli.dashboard.time.monotonic", lambda: clock[0])

    def stats(gen0: int, gen1: int) -> object:
        r0 = engine_stats(kv_blocks_total=1000, kv_blocks_used=500, num_running=64, num_waiting=8,
                          num_finished=10, generation_tokens=gen0)
        r1 = engine_stats(kv_blocks_total=1000, kv_blocks_used=250, num_running=32, num_waiting=0,
                          num_finished=7, generation_tokens=gen1)
        total = engine_stats(kv_blocks_total=2000, kv_blocks_used=750, generation_tokens=gen0 + gen1)
        total.replicas = [r0, r1, None]  # the third replica is gone
        return total

    console = Console(record=True, force_terminal=True, width=100, file=io.StringIO())
    live = LiveDashboard(console)
    live.start()
    live.update(progress(stats=stats(0, 0)))
    clock[0] = 102.0
    live.update(progress(stats=stats(4000, 1000)))  # 2,000 and 500 tok/s over the 2 s
    text = capture(render_dashboard(*live.last))
    assert "replica 0" in text and "gen 2,000 tok/s" in text and "KV 50%" in text and "waiting 8" in text
    assert "replica 1" in text and "gen 500 tok/s" in text and "KV 25%" in text
    assert "replica 2" in text and "gone" in text
    line = plain_line(*live.last)
    assert "replicas 2000tok/s,KV50% 500tok/s,KV25% gone" in line
