"""reasoning.py: where vLLM's qwen3 and deepseek_r1 parsers put a thinking model's reasoning and its answer; and, in
a job, the reasoning of chat lines in its own field (jobs/formatting.py), with tool calls read from the answer."""

from __future__ import annotations

import json

import pytest

from nvcli.config import ConfigError
from nvcli.engine.text import reasoning_markers
from nvcli.jobs.formatting import FormatContext, result_line
from nvcli.jobs.requests import Defaults, Request, parse_line
from nvcli.outputs import CompletionOutput, RequestOutput
from nvcli.reasoning import ReasoningSplit, reasoning_ended, split_reasoning


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>\nplan\n</think>\n\nanswer", True, ("\nplan\n", "\n\nanswer")),
    ("plan</think>answer", True, ("plan", "answer")),  # <think> was in the prompt
    ("<think>plan</think>", True, ("plan", None)),  # nothing after the reasoning
    ("<think></think>answer", True, ("", "answer")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # the first end marker ends it
])
def test_both_parsers_split_at_the_first_end_marker(parser: str, text: str, thinking: bool,
                                                    expected: tuple) -> None:
    assert split_reasoning(parser, text, thinking) == ReasoningSplit(*expected)


@pytest.mark.parametrize("text, thinking, qwen3, deepseek_r1", [
    # cut off while thinking: all reasoning, unless Qwen3's thinking was turned off for the line
    ("<think>still thinking", True, ("still thinking", None), ("still thinking", None)),
    ("just an answer", False, (None, "just an answer"), ("just an answer", None)),
    ("", True, (None, None), (None, None)),
])
def test_without_an_end_marker_the_parsers_differ_on_thinking_off(text: str, thinking: bool, qwen3: tuple,
                                                                 deepseek_r1: tuple) -> None:
    assert split_reasoning("qwen3", text, thinking) == ReasoningSplit(*qwen3)
    assert split_reasoning("deepseek_r1", text, thinking) == ReasoningSplit(*deepseek_r1)


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        split_reasoning("granite", "x")


@pytest.mark.parametrize("ids, ended", [
    ([1, 2, 3], False),  # no marker: the model has its reasoning ahead of it (Qwen3 with thinking on)
    ([1, 7, 2, 8, 3], True),  # <think> ... </think>: Qwen3's prompt with thinking off
    ([1, 8, 2, 7, 3], False),  # an earlier turn's reasoning ended, a new one began
    ([], False),
])
def test_reasoning_ended_reads_the_last_marker(ids: list[int], ended: bool) -> None:
    assert reasoning_ended(ids, 7, 8) is ended


class _Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_a_tokenizer_without_the_markers_is_a_config_error_naming_the_flag() -> None:
    assert reasoning_markers(_Vocab({"<think>": 5, "</think>": 6}), "qwen3") == (5, 6)
    assert reasoning_markers(_Vocab({}), None) is None
    with pytest.raises(ConfigError, match=r"--reasoning-parser=deepseek_r1: the tokenizer has no </think> token"):
        reasoning_markers(_Vocab({"<think>": 5}), "deepseek_r1")


CHAT = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "q"}], "max_tokens": 9}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def _format(line: dict, text: str, parser: str | None = "qwen3", finish: str = "stop") -> dict:
    req = parse_line(json.dumps(line), 0, Defaults())
    assert isinstance(req, Request)
    if req.tools is not None:
        req.tools.parser = "hermes"
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [3], finish)], True)
    return result_line(req, out, FormatContext("m", created=0, reasoning_parser=parser))


def test_a_chat_message_carries_the_reasoning_and_the_answer_as_content() -> None:
    body = _format(CHAT, "<think>\nhmm\n</think>\n\nforty-two")["response"]["body"]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "\n\nforty-two", "reasoning": "\nhmm\n"}
    cut = _format(CHAT, "<think>\nhmm", finish="length")["response"]["body"]["choices"][0]
    assert cut["message"] == {"role": "assistant", "content": None, "reasoning": "\nhmm"}
    assert cut["finish_reason"] == "length"
    plain = _format(CHAT, "<think>\nhmm\n</think>\n\nforty-two", parser=None)["response"]["body"]
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nforty-two"}


def test_thinking_turned_off_for_a_line_leaves_its_text_all_content() -> None:
    line = {**CHAT, "body": {**CHAT["body"], "chat_template_kwargs": {"enable_thinking": False}}}
    message = _format(line, "just the answer")["response"]["body"]["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "just the answer", "reasoning": None}


def test_a_native_chat_line_keeps_text_a_string_and_a_prompt_line_is_not_split() -> None:
    native = {"id": "n", "messages": [{"role": "user", "content": "q"}]}
    assert _format(native, "<think>a</think>b") | {"usage": None} == {
        "id": "n", "text": "b", "reasoning": "a", "finish_reason": "stop", "usage": None}
    assert _format(native, "<think>a", finish="length")["text"] == ""
    prompt_line = _format({"id": "p", "prompt": "q"}, "<think>a</think>b")
    assert prompt_line["text"] == "<think>a</think>b" and "reasoning" not in prompt_line


def test_tool_calls_are_read_from_the_answer_not_the_reasoning() -> None:
    line = {**CHAT, "body": {**CHAT["body"], "tools": TOOLS}}
    choice = _format(line, f"<think>maybe {CALL}?</think>\n\n{CALL}")["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert choice["message"]["reasoning"] == f"maybe {CALL}?"
    thinking_only = _format(line, f"<think>maybe {CALL}?", finish="length")["response"]["body"]["choices"][0]
    assert thinking_only["message"]["tool_calls"] == [] and thinking_only["finish_reason"] == "length"
