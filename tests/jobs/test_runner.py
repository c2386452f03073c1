from __future__ import annotations

import copy
import io
import json
import os
import signal
import threading
import time

import pytest
from fake_engine import FakeEngine, jsonl

from nvcli.jobs.requests import Defaults
from nvcli.jobs.runner import EXIT_LINE_ERRORS, EXIT_OK, EXIT_OUTPUT_CLOSED, JobOptions, run_job
from nvcli.jobs.tool_calls import required_schema
from nvcli.sampling_params import StructuredOutputsParams


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
    assert set(a) == {"id", "text", "finish_reason", "usage"} and a["id"] == 1
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
        assert len(lines) == n and sorted(x["id"] for x in lines) == list(range(1, n + 1))
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
    done = {id_key("r1"): False, id_key("r3"): True, id_key(7): False}
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


# -- tool calling --------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
SO = StructuredOutputsParams
QWEN_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
REPLIES = {"Q-auto": QWEN_CALLS, "Q-text": "It is sunny.", "Q-required": '[{"name": "now", "parameters": {}}]',
           "Q-named": '{"city": "Oslo"}', "Q-bad": '<tool_call>\n{"name": "now", "arguments": {}\n</tool_call>',
           "Q-llama": '{"name": "get_weather", "parameters": {"city": "Rome"}}'}


def chat(cid: str, question: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": question}], "tools": [WEATHER, NOW], **body}}


def message(line: dict) -> tuple[dict, str]:
    choice = line["response"]["body"]["choices"][0]
    return choice["message"], choice["finish_reason"]


def names_and_args(calls: list[dict]) -> list[tuple[str, dict]]:
    assert len({c["id"] for c in calls}) == len(calls) and all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_tool_calls_end_to_end_through_the_fake_engine():
    """Every tool_choice in both chat shapes, on scripted model answers: the tools reach the chat template, the
    constraint of "required" and named reaches the engine, and each answer carries the calls vLLM would find."""
    engine = FakeEngine(max_model_len=4000, replies=REPLIES)
    named = {"type": "function", "function": {"name": "get_weather"}}
    data = jsonl(
        chat("auto", "Q-auto"),
        chat("text", "Q-text", tool_choice="auto"),
        chat("required", "Q-required", tool_choice="required"),
        chat("named", "Q-named", tool_choice=named),
        chat("none", "Q-auto", tool_choice="none"),
        chat("bad", "Q-bad"),
        chat("single", "Q-auto", parallel_tool_calls=False),
        {"id": "native", "messages": [{"role": "user", "content": "Q-auto"}], "tools": [WEATHER]},
        {"id": "native-text", "messages": [{"role": "user", "content": "Q-text"}], "tools": [WEATHER]},
        {"id": "prompt", "prompt": "Q-auto", "tools": [WEATHER]},
        {"id": "plain", "messages": [{"role": "user", "content": "Q-auto"}]},
    )
    result, lines = run(engine, data, defaults=Defaults(sampling={"max_tokens": 500}))
    auto, text, required, named_, none, bad, single, native, native_text, prompt, plain = lines

    msg, finish = message(auto)
    assert (msg["role"], msg["content"], finish) == ("assistant", "I will look both up.\n", "tool_calls")
    assert names_and_args(msg["tool_calls"]) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"})]
    assert list(msg) == ["role", "content", "tool_calls"]
    assert message(text) == ({"role": "assistant", "content": "It is sunny.", "tool_calls": []}, "stop")
    msg, finish = message(required)
    assert (msg["content"], names_and_args(msg["tool_calls"]), finish) == ("", [("now", {})], "tool_calls")
    msg, finish = message(named_)
    assert (msg["content"], finish) == ("", "stop")
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert message(none) == ({"role": "assistant", "content": QWEN_CALLS, "tool_calls": []}, "stop")
    assert message(bad) == ({"role": "assistant", "content": REPLIES["Q-bad"], "tool_calls": []}, "stop")
    msg, finish = message(single)
    assert names_and_args(msg["tool_calls"]) == [("get_weather", {"city": "Paris"})] and finish == "tool_calls"
    assert (native["text"], native["finish_reason"]) == (QWEN_CALLS, "tool_calls")
    assert names_and_args(native["tool_calls"]) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"})]
    assert (native_text["text"], native_text["finish_reason"], native_text["tool_calls"]) == ("It is sunny.", "stop", [])
    assert prompt["error"]["type"] == "invalid_request" and "tools need \"messages\"" in prompt["error"]["message"]
    assert (plain["text"], plain["finish_reason"]) == (QWEN_CALLS, "stop") and "tool_calls" not in plain
    assert result.exit_code == EXIT_LINE_ERRORS and result.failed == 1

    # what reached the engine: the tools in every prompt that offers them (none included), the constraints
    tools_json = json.dumps([WEATHER, NOW])
    assert sum(tools_json in t for t in engine.rendered) == 7
    assert not any("<tools>" in t for t in engine.rendered[-1:])  # the plain line
    constraints = [sp.structured_outputs for sp in engine.sampling_seen]  # in input order; the prompt line is not
    assert constraints == [None, None, SO(json=required_schema([WEATHER, NOW])),
                           SO(json=WEATHER["function"]["parameters"]), None, None, None, None, None, None]


def test_an_assistant_tool_call_turn_and_a_tool_result_reach_the_template_parsed():
    engine = FakeEngine(max_model_len=4000, replies={"sunny": "It is sunny in Paris."})
    convo = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    _, (line,) = run(engine, jsonl(chat("turns", "x", messages=convo)), defaults=Defaults(sampling={"max_tokens": 500}))
    assert message(line) == ({"role": "assistant", "content": "It is sunny in Paris.", "tool_calls": []}, "stop")
    assert engine.rendered[0].endswith('<user>Weather in Paris?<assistant><call>{"name": "get_weather", "arguments": '
                                       '{"city": "Paris"}}</call><tool>sunny<assistant>')


def test_the_parser_comes_from_the_flag_or_the_template_and_a_template_without_tools_refuses_them():
    llama = FakeEngine(max_model_len=4000, replies=REPLIES)
    llama.tokenizer.chat_template = "{% if tools %}{{ tools }}{% endif %}<|python_tag|>"
    data = jsonl(chat("llama", "Q-llama"))
    _, (line,) = run(llama, data, defaults=Defaults(sampling={"max_tokens": 500}))
    msg, finish = message(line)
    assert (msg["content"], names_and_args(msg["tool_calls"]), finish) == (None, [("get_weather", {"city": "Rome"})],
                                                                          "tool_calls")
    # the flag wins over the template: hermes finds no <tool_call> in Llama's JSON
    _, (line,) = run(llama, data, defaults=Defaults(sampling={"max_tokens": 500}, tool_call_parser="hermes"))
    assert message(line) == ({"role": "assistant", "content": REPLIES["Q-llama"], "tool_calls": []}, "stop")

    unknown = FakeEngine(max_model_len=4000, replies=REPLIES)
    unknown.tokenizer.chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}"
    data = jsonl(chat("auto", "Q-auto"), chat("required", "Q-required", tool_choice="required"))
    _, (auto, required) = run(unknown, data, defaults=Defaults(sampling={"max_tokens": 500}))
    error = auto["response"]["body"]["error"]
    assert auto["response"]["status_code"] == 400 and "pass --tool-call-parser hermes, llama3_json or qwen3_coder" in error["message"]
    assert message(required)[1] == "tool_calls"  # no parser needed: the constraint gives the shape
    _, (auto, _) = run(unknown, data, defaults=Defaults(sampling={"max_tokens": 500}, tool_call_parser="hermes"))
    assert message(auto)[1] == "tool_calls"

    blind = FakeEngine(max_model_len=4000, replies=REPLIES)
    blind.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    _, (auto, required) = run(blind, data, defaults=Defaults(sampling={"max_tokens": 500}))
    for line in (auto, required):
        assert line["response"]["body"]["error"]["message"].startswith("this model's chat template does not render tools")
    assert blind.rendered == []


def test_a_qwen3_coder_template_gets_its_xml_calls_read_with_typed_arguments():
    """A template that shows the XML format (Qwen3-Coder, Qwen3.5) picks the qwen3_coder parser under "auto": the
    calls come back as OpenAI tool calls whose arguments follow the tool's parameter types."""
    xml = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n<parameter=days>\n"
           "2\n</parameter>\n</function>\n</tool_call>")
    engine = FakeEngine(max_model_len=4000, replies={"Q-xml": xml})
    engine.tokenizer.chat_template = ("{% if tools %}{{ tools }}<tool_call>\n<function=name>\n<parameter=key>\nvalue\n"
                                      "</parameter>\n</function>\n</tool_call>{% endif %}")
    weather = copy.deepcopy(WEATHER)
    weather["function"]["parameters"]["properties"]["days"] = {"type": "integer"}
    _, (line,) = run(engine, jsonl(chat("xml", "Q-xml", tools=[weather, NOW])),
                     defaults=Defaults(sampling={"max_tokens": 500}))
    msg, finish = message(line)
    assert (msg["content"], names_and_args(msg["tool_calls"]), finish) == \
        ("Checking.\n", [("get_weather", {"city": "Lima", "days": 2})], "tool_calls")
    # under hermes the same text has no JSON call in its block: it is all content
    _, (line,) = run(engine, jsonl(chat("xml", "Q-xml", tools=[weather, NOW])),
                     defaults=Defaults(sampling={"max_tokens": 500}, tool_call_parser="hermes"))
    assert message(line) == ({"role": "assistant", "content": xml, "tool_calls": []}, "stop")


def test_n_completions_are_each_read_for_calls():
    from nvcli.jobs.formatting import FormatContext, result_line
    from nvcli.jobs.requests import parse_line
    from nvcli.outputs import CompletionOutput, RequestOutput

    out = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], finished=True, outputs=[
        CompletionOutput(0, QWEN_CALLS, [5] * 7, "stop", None, None),
        CompletionOutput(1, "It is sunny.", [6] * 3, "stop", None, None),
        CompletionOutput(2, '<tool_call>\n{"name": "now", "arguments": {}}', [7] * 4, "length", None, None)])
    for line in (chat("n", "x", n=3), {"id": "n", "messages": [{"role": "user", "content": "x"}], "tools": [NOW], "n": 3}):
        req = parse_line(json.dumps(line), 0, Defaults())
        req.tools.parser = "hermes"
        got = result_line(req, out, FormatContext("m"))
        outs = got["response"]["body"]["choices"] if "response" in got else got["outputs"]
        calls = [names_and_args(o["message"]["tool_calls"] if "message" in o else o["tool_calls"]) for o in outs]
        assert calls == [[("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"})], [], [("now", {})]]
        assert [o["finish_reason"] for o in outs] == ["tool_calls", "stop", "tool_calls"]
        ids = [c["id"] for o in outs for c in (o["message"]["tool_calls"] if "message" in o else o["tool_calls"])]
        assert len(set(ids)) == 3


# Lines without tools, answered by the code before tool calling existed (commit 6edee32, this job on the fake engine);
# ids, request ids and the creation time vary by run and are normalized.
BEFORE_TOOLS = [
    '{"id":"n1","text":"gnub","finish_reason":"length","token_ids":[103,110,117,98],"logprobs":[{"token_id":103,"token":"g","logprob":-0.5,"top_logprobs":[{"token_id":103,"token":"g","logprob":-0.5}]},{"token_id":110,"token":"n","logprob":-0.5,"top_logprobs":[{"token_id":110,"token":"n","logprob":-0.5}]},{"token_id":117,"token":"u","logprob":-0.5,"top_logprobs":[{"token_id":117,"token":"u","logprob":-0.5}]},{"token_id":98,"token":"b","logprob":-0.5,"top_logprobs":[{"token_id":98,"token":"b","logprob":-0.5}]}],"usage":{"prompt_tokens":5,"completion_tokens":4}}',
    '{"id":"n2","text":"ipw","finish_reason":"length","usage":{"prompt_tokens":42,"completion_tokens":3}}',
    '{"id":"c1","custom_id":"c1","response":{"status_code":200,"request_id":"nv-batch-X","body":{"id":"chatcmpl-X","object":"chat.completion","created":0,"model":"model","choices":[{"index":0,"message":{"role":"assistant","content":"ipwdk"},"logprobs":{"content":[{"token":"i","logprob":-0.5,"bytes":[105],"top_logprobs":[{"token":"i","logprob":-0.5,"bytes":[105]}]},{"token":"p","logprob":-0.5,"bytes":[112],"top_logprobs":[{"token":"p","logprob":-0.5,"bytes":[112]}]},{"token":"w","logprob":-0.5,"bytes":[119],"top_logprobs":[{"token":"w","logprob":-0.5,"bytes":[119]}]},{"token":"d","logprob":-0.5,"bytes":[100],"top_logprobs":[{"token":"d","logprob":-0.5,"bytes":[100]}]},{"token":"k","logprob":-0.5,"bytes":[107],"top_logprobs":[{"token":"k","logprob":-0.5,"bytes":[107]}]}]},"finish_reason":"length"}],"usage":{"prompt_tokens":42,"completion_tokens":5,"total_tokens":47}}},"error":null}',
    '{"id":"c2","custom_id":"c2","response":{"status_code":200,"request_id":"nv-batch-X","body":{"id":"cmpl-X","object":"text_completion","created":0,"model":"model","choices":[{"index":0,"text":"abcipw","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}},"error":null}',
    '{"id":"s","text":"ta","finish_reason":"stop","usage":{"prompt_tokens":5,"completion_tokens":3}}',
    '{"id":"bad","error":{"type":"invalid_request","message":"prompt must be a string, got a number (3)","line":6}}',
]


def test_lines_without_tools_are_answered_byte_for_byte_as_before():
    """Tool calling adds nothing to a line that offers no tools (tool_choice "none" and an empty list included)."""
    import re

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    data = jsonl(
        {"id": "n1", "prompt": "Hello", "max_tokens": 4, "logprobs": 1, "return_token_ids": True},
        {"id": "n2", "messages": msgs, "max_tokens": 3, "tool_choice": "none", "tools": []},
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": msgs, "max_tokens": 5, "logprobs": True, "top_logprobs": 1,
                  "tool_choice": "none", "response_format": {"type": "json_object"}}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "abc", "max_tokens": 3, "echo": True}},
        {"id": "s", "prompt": "stop!"},
        {"id": "bad", "prompt": 3},
    )
    dst = io.BytesIO()
    run_job(FakeEngine(), io.BytesIO(data), dst,
            JobOptions(defaults=Defaults(sampling={"max_tokens": None}), handle_sigint=False))
    out = re.sub(r'"(nv-batch|chatcmpl|cmpl)-[0-9a-f]{32}"', r'"\1-X"', dst.getvalue().decode())
    out = re.sub(r'"created":\d+', '"created":0', out)
    assert out.splitlines() == BEFORE_TOOLS


def test_a_line_without_an_id_takes_the_line_number_its_error_gives(fake_engine):
    """Both 1-based, as an editor counts: the id of line 3 is 3, and its error says line 3."""
    _, lines = run(fake_engine, jsonl({"prompt": "a"}, {"prompt": "b"}, {"prompt": ""}))
    assert [x["id"] for x in lines] == [1, 2, 3]
    assert lines[2]["error"]["line"] == 3
