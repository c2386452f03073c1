"""The reader thread: prompts tokenized a batch at a time, never waiting for a batch to fill,
and a line that cannot be tokenized or rendered fails alone."""

from __future__ import annotations

import io
import json
import threading

import pytest
from fake_engine import FakeEngine

from nvcli.jobs.reader import BATCH_LINES, batched_lines
from nvcli.jobs.requests import Defaults
from nvcli.jobs.runner import EXIT_LINE_ERRORS, EXIT_OK, JobOptions, run_job


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _run(engine, src, **kw):
    dst = io.BytesIO()
    opts = JobOptions(handle_sigint=False, defaults=Defaults(sampling={"max_tokens": 2, "temperature": 0}), **kw)
    result = run_job(engine, src, dst, opts)
    return result, [json.loads(x) for x in dst.getvalue().splitlines()]


def _mixed_lines(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(_line({"id": i, "prompt": f"prompt number {i}"}))
        elif i % 3 == 1:
            out.append(_line({"id": i, "messages": [{"role": "user", "content": f"chat {i}"}]}))
        else:
            out.append(_line({"id": i, "prompt_token_ids": [100 + i % 7, 101]}))
    return out


def test_prompts_are_tokenized_a_batch_at_a_time_and_answered_in_order():
    engine = FakeEngine(max_num_seqs=64)
    lines = _mixed_lines(300)
    result, out = _run(engine, io.BytesIO(b"".join(lines)))
    assert result.exit_code == EXIT_OK and [x["id"] for x in out] == list(range(300))
    # each line's prompt tokens are its own text's (the fake tokenizer: one token per character)
    for x in out:
        i = x["id"]
        want = (len(f"prompt number {i}") if i % 3 == 0 else len(f"<user>chat {i}<assistant>") if i % 3 == 1 else 2)
        assert x["usage"]["prompt_tokens"] == want, x
    # 200 text and chat prompts in far fewer tokenizer calls, none larger than a batch
    assert sum(engine.encode_batches) == 200
    assert len(engine.encode_batches) < 50 and max(engine.encode_batches) <= BATCH_LINES


def test_a_pipe_giving_one_line_at_a_time_is_served_line_by_line():
    """The reader takes what has arrived: it never waits for more lines to fill a batch."""
    engine = FakeEngine()
    seen_before_second_line = threading.Event()

    def pipe():
        yield _line({"prompt": "first"})
        for _ in range(500):  # up to 5 s for the first line to reach the engine on its own
            if engine.added:
                seen_before_second_line.set()
                break
            threading.Event().wait(0.01)
        yield _line({"prompt": "second"})

    result, out = _run(engine, pipe())
    assert seen_before_second_line.is_set()
    assert result.written == 2 and [x["usage"]["prompt_tokens"] for x in out] == [5, 6]


class _PickyEngine(FakeEngine):
    """A tokenizer that cannot encode "BAD", a chat template that rejects "BAD"."""

    def encode_batch(self, texts, add_special_tokens=True):
        if any("BAD" in t for t in texts):
            raise ValueError("cannot encode BAD")
        return super().encode_batch(texts, add_special_tokens)

    def render_chat_text(self, messages, chat_template_kwargs=None):
        if any("BAD" in m["content"] for m in messages):
            raise ValueError("template says no")
        return super().render_chat_text(messages, chat_template_kwargs)


def test_a_prompt_the_tokenizer_rejects_fails_alone():
    lines = [_line({"id": i, "prompt": "BAD" if i == 5 else f"ok {i}"}) for i in range(12)]
    lines.insert(8, _line({"id": "chat", "messages": [{"role": "user", "content": "BAD"}]}))
    result, out = _run(_PickyEngine(), io.BytesIO(b"".join(lines)))
    assert [x["id"] for x in out] == [0, 1, 2, 3, 4, 5, 6, 7, "chat", 8, 9, 10, 11]
    errors = {x["id"]: x["error"] for x in out if "error" in x}
    assert set(errors) == {5, "chat"}
    assert "could not tokenize the prompt: cannot encode BAD" in errors[5]["message"]
    assert "could not render the chat template: template says no" in errors["chat"]["message"]
    assert result.exit_code == EXIT_LINE_ERRORS and result.succeeded == 11


class _ContextEngine(FakeEngine):
    """The engine's check of prompt + max_tokens against the context (LLMEngine.add_request's message)."""

    def add_request(self, prompt, sampling_params, request_id=None, prompt_text=None, priority=0):
        n = len(prompt)
        if sampling_params.max_tokens is not None and n + sampling_params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={sampling_params.max_tokens} is too large: the prompt has {n} tokens and "
                             f"max_model_len={self.max_model_len} leaves room for {self.max_model_len - n} more")
        return super().add_request(prompt, sampling_params, request_id, prompt_text, priority)


def test_max_tokens_beyond_the_context_gets_an_invalid_request_line():
    """vLLM's 400: a line whose prompt plus max_tokens exceeds the context is refused, not run to the end of it."""
    result, out = _run(_ContextEngine(), io.BytesIO(_line({"id": "big", "prompt": "hi", "max_tokens": 100000})
                                                    + _line({"id": "ok", "prompt": "hi", "max_tokens": 3})))
    assert out[0]["error"]["type"] == "invalid_request"
    assert out[0]["error"]["message"].startswith("max_tokens=100000 is too large")
    assert out[1]["usage"]["completion_tokens"] == 3
    assert result.exit_code == EXIT_LINE_ERRORS


def test_an_input_that_fails_mid_read_keeps_the_lines_before_it():
    def broken():
        yield from (_line({"prompt": f"p{i}"}) for i in range(3))
        raise OSError("disk went away")

    batches = []
    with pytest.raises(OSError, match="disk went away"):
        for batch in batched_lines(broken(), 64):
            batches.append(batch)
    assert [n for b in batches for n, _ in b] == [0, 1, 2]

    engine = FakeEngine()
    with pytest.raises(RuntimeError, match="reading the input failed: disk went away"):
        _run(engine, broken())
    assert len(engine.added) == 3


def test_batched_lines_keeps_every_line_in_order_at_any_batch_size():
    lines = [f"{i}\n".encode() for i in range(1000)]
    for size in (1, 7, 64):
        batches = list(batched_lines(iter(lines), size))
        assert [raw for b in batches for _, raw in b] == lines
        assert [n for b in batches for n, _ in b] == list(range(1000))
        assert max(len(b) for b in batches) <= size


def test_seen_ids_find_the_same_first_line_as_a_dict_of_every_id():
    """SeenIds keeps lines whose id is their own line number as bits; the answers are those of a dict of every id."""
    import random

    from nvcli.jobs.reader import SeenIds
    from nvcli.jobs.requests import id_key

    rnd = random.Random(4)
    for _ in range(50):
        seen, every = SeenIds(), {}
        for line_no in range(rnd.randint(1, 300)):
            kind = rnd.random()
            rid = (line_no + 1 if kind < 0.5 else rnd.randint(0, 320) if kind < 0.8 else str(rnd.randint(0, 320)))
            key = id_key(rid)
            assert seen.claim(rid, key, line_no) == every.setdefault(key, line_no), (line_no, rid)


def test_a_million_lines_without_ids_keep_little_memory():
    import tracemalloc

    from nvcli.jobs.reader import SeenIds
    from nvcli.jobs.requests import id_key

    seen = SeenIds()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for line_no in range(1_000_000):
        assert seen.claim(line_no + 1, id_key(line_no + 1), line_no) == line_no
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 512 * 1024  # 125 KB of bits (a dict of the ids held about 100 MB)
    assert seen.claim(1_000_000, id_key(1_000_000), 1_000_001) == 999_999  # a later line that gives one of them


def test_the_reader_says_whether_it_read_the_whole_input():
    result, _ = _run(FakeEngine(), io.BytesIO(_line({"prompt": "a"}) + _line({"prompt": "b"})))
    assert result.counts.exhausted


def test_a_lines_priority_reaches_the_engine_and_needs_the_priority_policy():
    """Under --scheduling-policy priority each line's priority goes to add_request; under fcfs (the default) a line
    with a priority other than 0 is refused as vLLM's engine refuses it, an invalid_request line naming the flag, and
    the job goes on."""
    from nvcli.config import EngineConfig

    lines = (_line({"id": "a", "prompt": "hi", "priority": 2}) + _line({"id": "b", "prompt": "hi"})
             + _line({"id": "c", "prompt": "hi", "priority": 0}))
    engine = FakeEngine()
    result, out = _run(engine, io.BytesIO(lines))
    assert out[0]["error"]["type"] == "invalid_request"
    assert out[0]["error"]["message"] == ("priority=2: priority scheduling is not enabled (pass --scheduling-policy "
                                          "priority)")
    assert [x["id"] for x in out[1:]] == ["b", "c"] and all("error" not in x for x in out[1:])
    assert result.exit_code == EXIT_LINE_ERRORS

    engine = FakeEngine()
    engine.config = EngineConfig(model="fake", device="cpu", scheduling_policy="priority")
    result, out = _run(engine, io.BytesIO(lines + _line({"id": "d", "prompt": "hi", "priority": -1})))
    assert result.exit_code == EXIT_OK and engine.priorities_seen == [2, 0, 0, -1]
