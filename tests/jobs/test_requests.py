from __future__ import annotations

import json

import pytest

from nvcli.jobs.requests import (
    CHAT,
    COMPLETION,
    DUPLICATE_ID,
    INVALID_JSON,
    INVALID_REQUEST,
    NATIVE,
    Defaults,
    LineError,
    Request,
    id_key,
    parse_line,
)


def parse(obj, line_no: int = 0, defaults: Defaults | None = None, warn=None):
    raw = obj if isinstance(obj, (bytes, str)) else json.dumps(obj)
    return parse_line(raw, line_no, defaults or Defaults(sampling={"max_tokens": None}), warn)


def test_native_prompt_with_overrides():
    r = parse({"id": "a", "prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": ["x"], "seed": 3}, 7,
              Defaults(sampling={"max_tokens": 100, "temperature": 0.8, "top_p": 0.9}))
    assert isinstance(r, Request)
    assert (r.id, r.key, r.shape, r.prompt) == ("a", "s:a", NATIVE, "hi")
    sp = r.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.stop_list, sp.seed) == (5, 0, 0.9, ["x"], 3)


def test_ids_default_to_custom_id_then_line_number():
    assert parse({"prompt": "x"}, 12).id == 12
    assert parse({"prompt": "x", "custom_id": "c"}, 12).id == "c"
    assert parse({"prompt": "x", "custom_id": "c", "id": 4}, 12).id == 4
    assert id_key(4) != id_key("4")


def test_messages_and_token_ids():
    r = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               "chat_template_kwargs": {"x": 1}}, defaults=Defaults(chat_template_kwargs={"enable_thinking": False}))
    assert r.messages[0]["content"] == "a\nb"
    assert r.chat_template_kwargs == {"enable_thinking": False, "x": 1}
    r = parse({"prompt_token_ids": [1, 2, 3], "logprobs": True, "return_token_ids": True})
    assert r.prompt_token_ids == [1, 2, 3] and r.sampling_params.logprobs == 0 and r.return_token_ids


def test_openai_chat_envelope():
    r = parse({"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                        "max_completion_tokens": 7, "temperature": 0.2, "logprobs": True, "top_logprobs": 2}})
    assert isinstance(r, Request)
    assert (r.shape, r.id, r.custom_id) == (CHAT, "req-1", "req-1")
    assert (r.sampling_params.max_tokens, r.sampling_params.temperature, r.sampling_params.logprobs) == (7, 0.2, 2)


def test_openai_completion_envelope():
    r = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": ["once"], "max_tokens": 3, "stop": "."}})
    assert (r.shape, r.prompt, r.sampling_params.max_tokens, r.sampling_params.stop_list) == (COMPLETION, "once", 3, ["."])
    r = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": [1, 2], "max_tokens": 3}})
    assert r.prompt_token_ids == [1, 2]


def test_bad_lines_become_errors_with_messages():
    cases = [
        (b'{"prompt": "x"', INVALID_JSON, "not valid JSON"),
        (b"[1, 2]", INVALID_REQUEST, "must be a JSON object"),
        ({"id": "a"}, INVALID_REQUEST, "missing prompt"),
        ({"prompt": ""}, INVALID_REQUEST, "prompt is empty"),
        ({"prompt": 5}, INVALID_REQUEST, "prompt must be a string"),
        ({"prompt": "x", "max_tokens": "ten"}, INVALID_REQUEST, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, INVALID_REQUEST, "temperature"),
        ({"messages": []}, INVALID_REQUEST, "messages is empty"),
        ({"messages": [{"content": "x"}]}, INVALID_REQUEST, "role"),
        ({"prompt_token_ids": [1, "a"]}, INVALID_REQUEST, "token ids"),
        ({"prompt": "x", "messages": []}, INVALID_REQUEST, "only one of"),
        ({"id": [1], "prompt": "x"}, INVALID_REQUEST, "id must be a string or an integer"),
        ({"custom_id": "z", "url": "/v1/embeddings", "body": {}}, INVALID_REQUEST, "unknown url"),
        ({"custom_id": "z", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], "n": 0}},
         INVALID_REQUEST, "body.n: must be a positive integer"),
        ({"custom_id": "z", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}],
                                                                     "frequency_penalty": 2.5}}, INVALID_REQUEST, "frequency_penalty: must be in [-2, 2]"),
    ]
    for line, kind, words in cases:
        r = parse(line, 3)
        assert isinstance(r, LineError), line
        assert r.kind == kind, (line, r)
        assert words in r.message, (line, r.message)
    # a line whose id cannot be read claims none (another line may own its line number as an id): keyed by position
    for unreadable in (b"{bad", b"[1, 2]", b'{"id": [1], "prompt": "x"}'):
        r = parse(unreadable, 3)
        assert (r.id, r.key) == (None, "l:3"), r
    assert parse({"prompt": "x"}, 3).id == 3  # a readable line without an id takes its line number
    assert parse({"custom_id": "z", "url": "/v1/embeddings", "body": {}}).shape in (CHAT, COMPLETION)
    assert DUPLICATE_ID  # produced by the reader, which sees every line


def test_unknown_fields_warn():
    seen = []
    r = parse({"prompt": "x", "max_token": 3}, warn=seen.append)
    assert isinstance(r, Request) and seen and "max_token" in seen[0]


def test_integral_floats_accepted():
    assert parse({"prompt": "x", "max_tokens": 10.0}).sampling_params.max_tokens == 10


def test_byte_order_mark_on_first_line():
    assert isinstance(parse(b'\xef\xbb\xbf{"prompt": "x"}', 0), Request)


def test_penalties_reach_the_sampling_params_in_every_shape():
    """presence / frequency / repetition penalties are served (the engine applies them), not refused as knobs nv lacks."""
    r = parse({"prompt": "x", "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.1})
    assert isinstance(r, Request), r
    sp = r.sampling_params
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == (0.5, -1, 1.1) and sp.has_penalties
    for url, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                      ("/v1/completions", {"prompt": "x"})):
        r = parse({"custom_id": "c", "url": url, "body": {**body, "frequency_penalty": 0.5, "presence_penalty": 0.1}})
        assert isinstance(r, Request), r
        assert (r.sampling_params.frequency_penalty, r.sampling_params.presence_penalty) == (0.5, 0.1)


def test_completions_echo_asks_for_the_prompts_logprobs():
    """echo with logprobs scores the prompt too (vLLM: prompt_logprobs = logprobs); max_tokens 0 with echo generates
    one token that the answer leaves out; echo is a /v1/completions knob only, and a boolean."""
    def body_of(**body) -> Request | LineError:
        return parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", **body}})

    r = body_of(echo=True, max_tokens=0, logprobs=2)
    assert isinstance(r, Request), r
    assert (r.echo, r.echo_prompt_only, r.sampling_params.max_tokens) == (True, True, 1)
    assert (r.sampling_params.logprobs, r.sampling_params.prompt_logprobs) == (2, 2)
    r = body_of(echo=True, max_tokens=4)
    assert isinstance(r, Request) and r.echo and not r.echo_prompt_only and r.sampling_params.prompt_logprobs is None
    r = body_of(echo=False, max_tokens=0)
    assert isinstance(r, LineError) and "max_tokens" in r.message
    r = body_of(echo=0)
    assert isinstance(r, LineError) and "body.echo must be true or false" in r.message
    r = parse({"custom_id": "c", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "x"}], "echo": True}})
    assert isinstance(r, LineError) and "/v1/completions only" in r.message
    r = parse({"custom_id": "c", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "x"}], "echo": False}})
    assert isinstance(r, Request)


def test_logit_bias_reaches_the_sampling_params_in_every_shape():
    """JSON object keys are strings: {"50256": -100} becomes {50256: -100.0} (native lines and OpenAI bodies alike);
    {} and null are no bias; a bias past [-100, 100] is clamped, as vLLM does."""
    cases = [({"50256": -100, "7": 2.5}, {50256: -100.0, 7: 2.5}), ({"3": 1e9}, {3: 100.0}), ({}, {}), (None, None)]
    for value, expected in cases:
        r = parse({"prompt": "x", "logit_bias": value})
        assert isinstance(r, Request), r
        assert r.sampling_params.logit_bias == expected
        for url, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                          ("/v1/completions", {"prompt": "x"})):
            r = parse({"custom_id": "c", "url": url, "body": {**body, "logit_bias": value}})
            assert isinstance(r, Request), r
            assert r.sampling_params.logit_bias == expected


@pytest.mark.parametrize("value, why", [
    ({"x": 1}, "keys must be token ids, strings of digits like \"50256\" (got 'x')"),
    ({"-1": 1}, "keys must be token ids, strings of digits like \"50256\" (got '-1')"),
    ({"1.0": 1}, "keys must be token ids, strings of digits like \"50256\" (got '1.0')"),
    ({" 1": 1}, "keys must be token ids, strings of digits like \"50256\" (got ' 1')"),
    ({"": 1}, "keys must be token ids, strings of digits like \"50256\" (got '')"),
    ({"5": "a"}, "values must be finite numbers (got 'a' for 5)"),
    ({"5": True}, "values must be finite numbers (got True for 5)"),
    ([[5, 1]], "must be a dict of {token id: bias} or None"),
    (5, "must be a dict of {token id: bias} or None"),
])
def test_a_bad_logit_bias_is_the_lines_error(value, why):
    r = parse({"id": "a", "prompt": "x", "logit_bias": value})
    assert isinstance(r, LineError) and r.kind == INVALID_REQUEST and r.message.startswith("logit_bias: " + why), r
    body = {"messages": [{"role": "user", "content": "x"}], "logit_bias": value}
    r = parse({"custom_id": "c", "url": "/v1/chat/completions", "body": body})
    assert isinstance(r, LineError) and r.kind == INVALID_REQUEST and r.message.startswith("body.logit_bias: " + why), r


@pytest.mark.parametrize("field,value,ok", [
    ("tool_choice", "none", True), ("tool_choice", "auto", False),
    ("response_format", {"type": "text"}, True), ("response_format", {"type": "json_object"}, False),
    ("tools", [], True), ("best_of", 1, True), ("best_of", 2, False),
])
def test_openai_knobs_nv_lacks_are_accepted_at_their_neutral_values(field, value, ok):
    """Clients send the defaults explicitly (tool_choice "none", response_format text): those are served; any value
    that would change the answer is the line's error, naming the field."""
    body = {"messages": [{"role": "user", "content": "x"}], field: value}
    r = parse({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body})
    if ok:
        assert isinstance(r, Request), r
    else:
        assert isinstance(r, LineError) and f"body.{field}=" in r.message
