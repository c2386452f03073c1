from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import pytest
from fake_engine import FakeEngine

from nvcli.jobs.requests import Defaults
from nvcli.jobs.runner import EXIT_LINE_ERRORS, EXIT_OK, EXIT_OUTPUT_CLOSED, JobOptions, run_job


def jsonl(*objs) -> bytes:
    return b"".join((o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs)


def run(engine, data: bytes, **kw):
    dst = io.BytesIO()
    kw.setdefault("defaults", Defaults(sampling={"max_tokens": 4, "temperature": 0}))
    result = run_job(engine, io.BytesIO(data), dst, JobOptions(handle_sigint=False, **kw))
    lines = [json.loads(x) for x in dst.getvalue().splitlines()]
    return result, lines


def test_ordered_output_matches_input_order(fake_engine):
    # long requests first so later ones finish earlier
    data = jsonl(*[{"id": f"r{i}", "prompt": f"p{i}", "max_tokens": 20 - i} for i in range(12)])
    result, lines = run(fake_engine, data)
    assert [x["id"] for x in lines] == [f"r{i}" for i in range(12)]
    assert [x["usage"]["completion_tokens"] for x in lines] == [20 - i for i in range(12)]
    assert all(x["finish_reason"] == "length" for x in lines)
    assert result.exit_code == EXIT_OK and result.succeeded == 12


def test_unordered_output_is_completion_order_and_complete(fake_engine):
    data = jsonl(*[{"id": i, "prompt": f"p{i}", "max_tokens": 20 - i} for i in range(12)])
    _, lines = run(fake_engine, data, ordered=False)
    ids = [x["id"] for x in lines]
    assert sorted(ids) == list(range(12)) and ids != list(range(12))


def test_same_results_ordered_and_unordered():
    data = jsonl(*[{"prompt": f"prompt {i}", "max_tokens": 1 + i % 5} for i in range(30)])
    _, a = run(FakeEngine(), data)
    _, b = run(FakeEngine(), data, ordered=False)
    assert sorted(a, key=lambda x: x["id"]) == sorted(b, key=lambda x: x["id"])


def test_all_shapes_and_stop(fake_engine):
    data = jsonl(
        {"prompt": "hello"},
        {"prompt": "bang!", "max_tokens": 10},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt_token_ids": [104, 105], "return_token_ids": True, "logprobs": 1},
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 1}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "abc", "max_tokens": 2, "logprobs": 1}},
    )
    result, lines = run(fake_engine, data, model_name="tiny")
    assert result.exit_code == EXIT_OK
    a, b, c, d, e, f = lines
    assert set(a) == {"id", "text", "finish_reason", "usage"} and a["id"] == 0
    assert a["usage"] == {"prompt_tokens": 5, "completion_tokens": 4}
    assert b["finish_reason"] == "stop"
    assert c["usage"]["prompt_tokens"] == len("<user>hi<assistant>")
    assert len(d["token_ids"]) == 4 and d["logprobs"][0]["logprob"] == -0.5 and len(d["logprobs"][0]["top_logprobs"]) == 1
    assert e["id"] == "c1" and e["custom_id"] == "c1" and e["error"] is None
    body = e["response"]["body"]
    assert e["response"]["status_code"] == 200 and body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    assert body["usage"] == {"prompt_tokens": 19, "completion_tokens": 3, "total_tokens": 22}
    body = f["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == fake_text("abc", 2)
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 2


def fake_text(prompt: str, n: int) -> str:
    s = sum(ord(c) for c in prompt)
    return "".join(chr(97 + (s + 7 * i) % 26) for i in range(n))


def test_every_bad_line_gets_exactly_one_error_line():
    engine = FakeEngine(max_model_len=50)
    data = jsonl(
        {"id": "ok1", "prompt": "fine"},
        b'{"id": "torn", "prompt": "x',
        {"id": "types", "prompt": "x", "max_tokens": "many"},
        {"id": "empty", "prompt": ""},
        {"id": "missing"},
        {"id": "long", "prompt": "x" * 51},
        {"id": "longchat", "messages": [{"role": "user", "content": "y" * 60}]},
        {"id": "ok1", "prompt": "again"},
        {"custom_id": "u", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "badtemp", "url": "/v1/completions", "body": {"prompt": "x", "temperature": "hot"}},
        b"",
        b"   ",
        {"id": "ok2", "prompt": "fine too"},
    )
    result, lines = run(engine, data)
    assert len(lines) == 11  # 13 lines, 2 blank
    by_id = {x["id"]: x for x in lines}
    assert len(by_id) == 10  # "ok1" twice: the answer and the duplicate error
    assert "text" in lines[0] and lines[7]["error"]["type"] == "duplicate_id" and "duplicate id" in lines[7]["error"]["message"]
    # unparsable: no id of its own (null), its 1-based line number in the error
    assert by_id[None]["error"]["type"] == "invalid_json" and by_id[None]["error"]["line"] == 2
    assert by_id["types"]["error"]["type"] == "invalid_request"
    assert by_id["empty"]["error"]["message"] == "prompt is empty"
    assert "missing prompt" in by_id["missing"]["error"]["message"]
    assert by_id["long"]["error"]["type"] == "prompt_too_long" and "max_model_len" in by_id["long"]["error"]["message"]
    assert by_id["longchat"]["error"]["type"] == "prompt_too_long"
    for cid in ("u", "badtemp"):
        x = by_id[cid]
        assert x["custom_id"] == cid and x["response"]["status_code"] == 400
        assert x["response"]["body"]["error"]["message"]
    assert "text" in by_id["ok2"]
    assert result.failed == 9 and result.succeeded == 2 and result.counts.blank == 2
    assert result.exit_code == EXIT_LINE_ERRORS


def test_broken_json_in_openai_file_keeps_openai_shape(fake_engine):
    data = jsonl({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}, b"{nope")
    _, lines = run(fake_engine, data)
    assert lines[1]["response"]["status_code"] == 400 and lines[1]["id"] is None
    assert lines[1]["response"]["body"]["error"]["line"] == 2


def test_read_ahead_is_bounded():
    """A slow engine and a long input: the reader never runs more than max_in_flight ahead."""
    engine = FakeEngine(max_num_seqs=2)
    n = 300
    data = jsonl(*[{"prompt": f"p{i}", "max_tokens": 1 + (i * 7) % 5} for i in range(n)])
    for ordered in (True, False):
        engine.max_unfinished_seen = 0
        result, lines = run(engine, data, ordered=ordered, max_in_flight=8)
        assert len(lines) == n and sorted(x["id"] for x in lines) == list(range(n))
        assert engine.max_unfinished_seen <= 8


class SlowPipe(io.RawIOBase):
    """A stdin-like pipe that yields lines slowly and records how far it has been read."""

    def __init__(self, lines: list[bytes], delay: float = 0.0):
        self.lines = list(lines)
        self.delay = delay
        self.served = 0

    def readable(self):
        return True

    def readline(self, size=-1):
        if self.delay:
            time.sleep(self.delay)
        if not self.lines:
            return b""
        self.served += 1
        return self.lines.pop(0)

    def __iter__(self):
        return self

    def __next__(self):
        line = self.readline()
        if not line:
            raise StopIteration
        return line


def test_streaming_input_is_served_while_read():
    """Results come out before the input ends (producer/consumer, not read-all-then-run)."""
    lines = [json.dumps({"prompt": f"p{i}", "max_tokens": 1}).encode() + b"\n" for i in range(20)]
    pipe = SlowPipe(lines, delay=0.02)

    class Spy(io.BytesIO):
        first_write_at_served = None

        def write(self, b):
            if Spy.first_write_at_served is None:
                Spy.first_write_at_served = pipe.served
            return super().write(b)

    dst = Spy()
    result = run_job(FakeEngine(), pipe, dst, JobOptions(handle_sigint=False))
    assert result.written == 20
    assert Spy.first_write_at_served is not None and Spy.first_write_at_served < 20


def test_resume_skips_done_ids(fake_engine):
    from nvcli.jobs.requests import id_key

    data = jsonl(*[{"id": f"r{i}", "prompt": f"p{i}"} for i in range(6)], {"prompt": "no id"})
    done = {id_key("r1"): False, id_key("r3"): True, id_key(6): False}
    result, lines = run(fake_engine, data, done=done)
    assert [x["id"] for x in lines] == ["r0", "r2", "r4", "r5"]
    assert result.counts.skipped == 3 and result.counts.skipped_errors == 1
    assert result.exit_code == EXIT_LINE_ERRORS  # the earlier run's error line still stands


class ClosedPipe(io.RawIOBase):
    def __init__(self, after: int):
        self.after = after
        self.n = 0

    def writable(self):
        return True

    def write(self, b):
        self.n += 1
        if self.n > self.after:
            raise BrokenPipeError(32, "Broken pipe")
        return len(b)


def test_broken_pipe_stops_the_job_quietly():
    engine = FakeEngine()
    data = jsonl(*[{"prompt": f"p{i}"} for i in range(50)])
    result = run_job(engine, io.BytesIO(data), ClosedPipe(after=1), JobOptions(handle_sigint=False))
    assert result.output_closed and result.exit_code == EXIT_OUTPUT_CLOSED
    assert not engine.has_unfinished()


def test_engine_failure_propagates_after_writing_finished_lines():
    class Boom(FakeEngine):
        steps = 0

        def step(self):
            Boom.steps += 1
            if Boom.steps > 6:
                raise RuntimeError("worker died")
            return super().step()

    dst = io.BytesIO()
    data = jsonl(*[{"prompt": f"p{i}", "max_tokens": 1 + i} for i in range(10)])
    try:
        run_job(Boom(), io.BytesIO(data), dst, JobOptions(handle_sigint=False, defaults=Defaults(sampling={"max_tokens": 3})))
    except RuntimeError as e:
        assert "worker died" in str(e)
    else:
        raise AssertionError("expected the engine error")
    assert len(dst.getvalue().splitlines()) >= 1


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_sigint_or_sigterm_drains_in_flight_then_stops(sig: int, code: int):
    """First Ctrl-C, or the SIGTERM a batch scheduler sends before its SIGKILL: stop reading, finish what is in the
    engine, exit 130 / 143; nothing is torn or lost. SIGTERM used to end the process at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    engine = FakeEngine(max_num_seqs=4, step_delay=0.002)
    n = 400
    data = jsonl(*[{"id": i, "prompt": f"p{i}", "max_tokens": 5} for i in range(n)])
    dst = io.BytesIO()
    before = signal.getsignal(sig)
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), sig))
    timer.start()
    result = run_job(engine, io.BytesIO(data), dst, JobOptions(max_in_flight=16))
    timer.cancel()
    lines = [json.loads(x) for x in dst.getvalue().splitlines()]
    assert result.interrupted and result.terminated == (sig == signal.SIGTERM) and result.exit_code == code
    assert signal.getsignal(sig) is before  # the job's handler is gone afterwards
    assert 0 < len(lines) < n
    assert [x["id"] for x in lines] == list(range(len(lines)))  # an in-order prefix: --resume continues it
    assert all("text" in x for x in lines)
    assert not engine.has_unfinished() and not engine.aborted


def test_iter_fd_lines_splits_like_readline(tmp_path):
    from nvcli.jobs.reader import iter_fd_lines

    data = b'{"a": 1}\n\n' + b"x" * 200_000 + b"\n" + b"tail without newline"
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = list(iter_fd_lines(fd, chunk_size=7))
    finally:
        os.close(fd)
    assert got == io.BytesIO(data).readlines()


def test_a_line_with_penalties_is_served_with_them(tiny_model_dir):
    """A real engine serves a line with frequency_penalty 0.5 (and an OpenAI line with presence_penalty): no error
    line, and the tokens are those of the engine sampling with the penalty."""
    from nvcli import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=64)
    ids = list(range(1000, 1005))
    data = jsonl(
        {"id": "f", "prompt_token_ids": ids, "frequency_penalty": 0.5, "max_tokens": 12, "return_token_ids": True},
        {"id": "p", "prompt_token_ids": ids, "max_tokens": 12, "return_token_ids": True},
        {"custom_id": "o", "url": "/v1/completions",
         "body": {"prompt": ids, "max_tokens": 12, "presence_penalty": 1.5, "frequency_penalty": 0.5}},
    )
    defaults = Defaults(sampling={"max_tokens": 4, "temperature": 0, "ignore_eos": True})
    result, (f, p, o) = run(llm.engine, data, defaults=defaults)
    assert result.exit_code == EXIT_OK and result.failed == 0
    assert "error" not in f and o["error"] is None and o["response"]["status_code"] == 200
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    penalized, plain = llm.generate([ids, ids], [SamplingParams(frequency_penalty=0.5, **greedy), SamplingParams(**greedy)])
    assert f["token_ids"] == penalized.outputs[0].token_ids != plain.outputs[0].token_ids
    assert p["token_ids"] == plain.outputs[0].token_ids
