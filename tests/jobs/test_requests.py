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
from nvcli.sampling_params import StructuredOutputsParams


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
    assert parse({"prompt": "x"}, 12).id == 13  # line 13 as an editor counts (line_no is 0-based)
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
    assert parse({"prompt": "x"}, 3).id == 4  # a readable line without an id takes its line number, 1-based
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
    ([[5, 1]], "must be a dict of {token id: bias} (got"),
    (5, "must be a dict of {token id: bias} (got"),
])
def test_a_bad_logit_bias_is_the_lines_error(value, why):
    r = parse({"id": "a", "prompt": "x", "logit_bias": value})
    assert isinstance(r, LineError) and r.kind == INVALID_REQUEST and r.message.startswith("logit_bias: " + why), r
    body = {"messages": [{"role": "user", "content": "x"}], "logit_bias": value}
    r = parse({"custom_id": "c", "url": "/v1/chat/completions", "body": body})
    assert isinstance(r, LineError) and r.kind == INVALID_REQUEST and r.message.startswith("body.logit_bias: " + why), r


@pytest.mark.parametrize("field,value,ok", [
    ("tool_choice", "none", True), ("tool_choice", "auto", False),
    ("response_format", {"type": "text"}, True),
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


# -- structured outputs ------------------------------------------------------------------------------------------
SO = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SHAPES = ("native", "chat", "completion")
TAG = {"triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": {"type": "object"}, "end": "</function>"}]}


def constrained_line(shape: str, fields: dict) -> dict:
    """A line of `shape` with `fields` where that shape takes them: the top level, or the OpenAI body."""
    if shape == "native":
        return {"id": "a", "prompt": "x", **fields}
    if shape == "chat":
        return {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "x"}], **fields}}
    return {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", **fields}}


def constraint_of(shape: str, fields: dict, defaults: Defaults | None = None, warn=None):
    r = parse(constrained_line(shape, fields), defaults=defaults, warn=warn)
    assert isinstance(r, Request), r
    return r.sampling_params.structured_outputs


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, SO(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     SO(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, SO(json=SCHEMA)),
])
def test_response_format_sets_the_constraint_in_every_shape(shape, fields, expected):
    """OpenAI's response_format (vLLM takes it on chat and completions requests; nv on native lines too): text is no
    constraint, json_object any JSON object, json_schema its schema."""
    assert constraint_of(shape, fields) == expected


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fields, expected", [
    ({"structured_outputs": {"json": SCHEMA}}, SO(json=SCHEMA)),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, SO(json='{"type": "integer"}')),
    ({"structured_outputs": {"regex": "[0-9]+"}}, SO(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, SO(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, SO(grammar='start: "a"+')),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     SO(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"json": SCHEMA, "regex": None, "json_object": False, "backend": "xgrammar",
                             "disable_fallback": True, "whitespace_pattern": None}}, SO(json=SCHEMA)),
    ({"structured_outputs": None}, None),
    ({"structured_outputs": {"disable_any_whitespace": False}}, None),
    ({"guided_json": SCHEMA}, SO(json=SCHEMA)),
    ({"guided_json": '{"type": "integer"}'}, SO(json='{"type": "integer"}')),
    ({"guided_regex": "[0-9]+", "guided_decoding_backend": "outlines"}, SO(regex="[0-9]+")),
    ({"guided_choice": ["yes", "no"], "guided_whitespace_pattern": None}, SO(choice=["yes", "no"])),
    ({"guided_grammar": 'start: "a"+'}, SO(grammar='start: "a"+')),
    ({"guided_json": None, "guided_regex": None, "guided_decoding_backend": "auto"}, None),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     SO(json_object=True, disable_any_whitespace=True)),  # vLLM fills response_format into structured_outputs
    ({"response_format": {"type": "structural_tag", **TAG}}, SO(structural_tag=TAG)),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG), "disable_any_whitespace": True}},
     SO(structural_tag=json.dumps(TAG), disable_any_whitespace=True)),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     SO(json=SCHEMA, disable_additional_properties=True)),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}}, SO(json=SCHEMA, whitespace_pattern=" ?")),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ \n]?"}, SO(json=SCHEMA, whitespace_pattern="[ \n]?")),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": " ?",
      "structured_outputs": {"whitespace_pattern": " ?"}}, SO(json_object=True, whitespace_pattern=" ?")),
])
def test_vllm_structured_outputs_and_guided_fields_in_every_shape(shape, fields, expected):
    """vLLM's structured_outputs object and its older guided_* fields, on native lines and in OpenAI bodies alike;
    none of them is an unknown field."""
    seen: list[str] = []
    assert constraint_of(shape, fields, warn=seen.append) == expected
    assert seen == []


def test_the_constraint_reaches_every_completion_and_the_other_sampling_fields_stay():
    r = parse({"prompt": "x", "n": 3, "temperature": 0.5, "max_tokens": 9, "guided_choice": ["a", "b"]})
    sp = r.sampling_params
    assert (sp.n, sp.temperature, sp.max_tokens, sp.structured_outputs) == (3, 0.5, 9, SO(choice=["a", "b"]))


def test_an_unknown_key_of_structured_outputs_warns():
    seen: list[str] = []
    assert constraint_of("chat", {"structured_outputs": {"regex": "a", "regx": "b"}}, warn=seen.append) == SO(regex="a")
    assert seen == ["ignoring unknown field 'body.structured_outputs.regx'"]


TYPES = '"text", "json_object", "json_schema", "structural_tag"'


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "xml"}}, f"response_format.type 'xml' is not supported: nv serves {TYPES}"),
    ({"response_format": {"type": "structural_tag"}},
     'response_format: "triggers" must be a non-empty list of non-empty strings'),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}},
     "response_format: the {\"format\": ...} form (xgrammar's newer structural tag) is not supported"),
    ({"structured_outputs": {"structural_tag": {**TAG, "triggers": ["<tool"]}}},
     "structured_outputs.structural_tag: structures[0].begin '<function=get_weather>' starts with none of the "
     "triggers ['<tool']"),
    ({"structured_outputs": {"structural_tag": {**TAG, "structures": [{"begin": "<function=f>", "end": ""}]}}},
     "structured_outputs.structural_tag: structures[0].schema must be a JSON schema (an object)"),
    ({"structured_outputs": {"structural_tag": "{not json"}},
     "structured_outputs.structural_tag: is not valid JSON text"),
    ({"structured_outputs": {"structural_tag": 3}},
     'structured_outputs.structural_tag: must be a structural tag {"triggers", "structures"} or its JSON text'),
    ({"response_format": {}},
     f"response_format.type must be one of {TYPES}, got null"),
    ({"response_format": "json_object"},
     'response_format must be a JSON object like {"type": "json_object"}, got a string'),
    ({"response_format": {"type": "json_schema"}},
     'response_format.json_schema must be a JSON object {"name", "schema"} when response_format.type is '
     '"json_schema", got null'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema must be a JSON schema (an object), got null"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
     "response_format.json_schema.schema must be a JSON schema (an object), got a string"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "give one output constraint per line (got 2: response_format, guided_regex)"),
    ({"structured_outputs": {"json": SCHEMA}, "guided_json": SCHEMA},
     "give one output constraint per line (got 2: structured_outputs.json, guided_json)"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "give one output constraint per line (got 2: structured_outputs.regex, structured_outputs.choice)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "guided_choice": ["a"],
      "structured_outputs": {"grammar": "start: x"}},
     "give one output constraint per line (got 3: response_format.json_schema.schema, structured_outputs.grammar, "
     "guided_choice)"),
    ({"guided_regex": 5}, "guided_regex: must be a non-empty string (got 5)"),
    ({"guided_regex": False}, "guided_regex: must be a non-empty string (got False)"),
    ({"guided_regex": ""}, "guided_regex: must be a non-empty string (got '')"),
    ({"guided_choice": []}, "guided_choice: must be a non-empty list of non-empty strings (got [])"),
    ({"guided_choice": "yes"}, "guided_choice: must be a non-empty list of non-empty strings (got 'yes')"),
    ({"guided_grammar": " "}, "guided_grammar: must be a non-empty Lark or GBNF grammar (got ' ')"),
    ({"guided_json": [1]}, "guided_json: must be a JSON schema: a dict or its JSON text (got [1])"),
    ({"guided_json": 0}, "guided_json: must be a JSON schema: an object or its JSON text (got 0)"),
    ({"structured_outputs": {"json": "{bad"}}, "structured_outputs.json: is not valid JSON text"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object: must be true or false (got 1)"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace: must be true or false (got 'yes')"),
    ({"structured_outputs": {"disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace needs a constraint: set one of json, json_object, regex, choice, "
     "grammar, structural_tag"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": 1}},
     "structured_outputs.disable_additional_properties: must be true or false (got 1)"),
    ({"structured_outputs": ["regex", "a"]},
     'structured_outputs must be a JSON object like {"json": {...}} or {"regex": "..."}, got a list'),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern: applies to JSON only: set it with json, json_object or structural_tag "
     "(got ' ')"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": 3},
     "guided_whitespace_pattern: must be a non-empty regular expression, the whitespace JSON may have between its "
     "tokens (got 3)"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ", "structured_outputs": {"whitespace_pattern": "\n"}},
     "guided_whitespace_pattern and structured_outputs.whitespace_pattern differ: give one"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern: contradicts disable_any_whitespace (which allows no whitespace): give "
     "one of them (got ' ')"),
    ({"guided_whitespace_pattern": " "},
     "guided_whitespace_pattern needs a constraint: set one of json, json_object, regex, choice, grammar, "
     "structural_tag"),
    ({"guided_regex": "a", "guided_decoding_backend": 1}, "guided_decoding_backend must be a string, got a number (1)"),
])
def test_a_constraint_nv_cannot_serve_is_the_lines_error(shape, fields, message):
    """Each message names the field as the line spells it (body. in an OpenAI request); a bad value gets
    StructuredOutputsParams' own words."""
    r = parse(constrained_line(shape, fields))
    assert isinstance(r, LineError) and r.kind == INVALID_REQUEST and r.id == "a", r
    prefix = "" if shape == "native" else "body."
    expected = message.replace("response_format", prefix + "response_format").replace(
        "structured_outputs", prefix + "structured_outputs").replace("guided_", prefix + "guided_")
    assert r.message.startswith(expected), (r.message, expected)
    assert r.shape == (NATIVE if shape == "native" else CHAT if shape == "chat" else COMPLETION)


def test_the_job_schema_constrains_every_line_that_sets_no_constraint_of_its_own():
    """--json-schema (Defaults.structured_outputs): lines without a constraint take it (response_format text is no
    constraint); a line's own response_format, structured_outputs or guided_* field wins; a line's
    disable_any_whitespace alone keeps the job's schema, compact."""
    job = SO(json={"type": "array"})
    defaults = Defaults(sampling={"max_tokens": None}, structured_outputs=job)
    for shape in SHAPES:
        assert constraint_of(shape, {}, defaults) == job
        assert constraint_of(shape, {"response_format": {"type": "text"}}, defaults) == job
        assert constraint_of(shape, {"guided_regex": "a+"}, defaults) == SO(regex="a+")
        assert constraint_of(shape, {"response_format": {"type": "json_object"}}, defaults) == SO(json_object=True)
        assert constraint_of(shape, {"structured_outputs": {"choice": ["a"]}}, defaults) == SO(choice=["a"])
        assert constraint_of(shape, {"structured_outputs": {"disable_any_whitespace": True}}, defaults) == SO(
            json={"type": "array"}, disable_any_whitespace=True)
        r = parse(constrained_line(shape, {"guided_regex": "a", "guided_choice": ["a"]}), defaults=defaults)
        assert isinstance(r, LineError) and "one output constraint" in r.message
    assert job == SO(json={"type": "array"})  # the job's own stays as it was
    assert constraint_of("native", {}) is None  # no --json-schema: no constraint


# -- tool calling (nvcli/jobs/tool_calls.py) ----------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CHAT_SHAPES = ("native", "chat")


def tool_line(shape: str, fields: dict, messages: list | None = None) -> dict:
    """A chat line of `shape` (native messages or /v1/chat/completions) with `fields` where that shape takes them."""
    if shape == "native":
        return {"id": "a", "messages": messages or USER, **fields}
    return {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": messages or USER, **fields}}


@pytest.mark.parametrize("shape", CHAT_SHAPES)
def test_tools_reach_the_request_in_both_chat_shapes(shape):
    from nvcli.jobs.tool_calls import AUTO, NAMED, REQUIRED, named_schema, required_schema

    seen: list[str] = []
    r = parse(tool_line(shape, {"tools": [WEATHER, NOW], "parallel_tool_calls": True}), warn=seen.append)
    assert isinstance(r, Request) and seen == []
    assert (r.tools.tools, r.tools.choice, r.tools.parallel) == ([WEATHER, NOW], AUTO, True)
    assert r.sampling_params.structured_outputs is None  # auto: the model answers freely
    r = parse(tool_line(shape, {"tools": [WEATHER, NOW], "tool_choice": "required", "parallel_tool_calls": False}))
    assert r.tools.choice == REQUIRED
    assert r.sampling_params.structured_outputs == SO(json=required_schema([WEATHER, NOW], parallel=False))
    r = parse(tool_line(shape, {"tools": [WEATHER, NOW], "n": 2,
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert (r.tools.choice, r.tools.name, r.sampling_params.n) == (NAMED, "get_weather", 2)
    assert r.sampling_params.structured_outputs == SO(json=named_schema([WEATHER], "get_weather"))
    for no_tools in ({}, {"tools": []}, {"tools": None, "tool_choice": "none"}, {"tools": [], "tool_choice": "none"}):
        r = parse(tool_line(shape, no_tools))
        assert isinstance(r, Request) and r.tools is None, no_tools


@pytest.mark.parametrize("shape", CHAT_SHAPES)
def test_a_tool_choice_constraint_replaces_the_jobs_and_admits_no_other(shape):
    """tool_choice "required" or named: that schema is the line's constraint, over --json-schema; a line that also
    sets its own is the line's error (one constraint per line); disable_any_whitespace alone keeps the tool calls
    compact. "none" and "auto" leave the constraints as they are."""
    from nvcli.jobs.tool_calls import named_schema

    job = SO(json={"type": "array"})
    defaults = Defaults(sampling={"max_tokens": None}, structured_outputs=job)
    named = {"type": "function", "function": {"name": "get_weather"}}
    prefix = "" if shape == "native" else "body."

    def constraint(fields):
        r = parse(tool_line(shape, {"tools": [WEATHER], **fields}), defaults=defaults)
        assert isinstance(r, Request), r
        return r.sampling_params.structured_outputs

    assert constraint({"tool_choice": named}) == SO(json=named_schema([WEATHER], "get_weather"))
    assert constraint({"tool_choice": named, "structured_outputs": {"disable_any_whitespace": True}}) == SO(
        json=named_schema([WEATHER], "get_weather"), disable_any_whitespace=True)
    assert constraint({"tool_choice": named, "response_format": {"type": "text"}}) == SO(
        json=named_schema([WEATHER], "get_weather"))
    assert constraint({"tool_choice": "auto"}) == job
    assert constraint({"tool_choice": "none", "guided_regex": "a+"}) == SO(regex="a+")
    assert constraint({"tool_choice": "auto", "response_format": {"type": "json_object"}}) == SO(json_object=True)
    for own, name in (({"response_format": {"type": "json_object"}}, "response_format"),
                      ({"structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
                      ({"guided_json": SCHEMA}, "guided_json")):
        for choice, said in (("required", "required"), (named, "naming 'get_weather'")):
            r = parse(tool_line(shape, {"tools": [WEATHER], "tool_choice": choice, **own}), defaults=defaults)
            assert isinstance(r, LineError) and r.kind == INVALID_REQUEST, r
            assert r.message == (f"give one output constraint per line (got 2: {prefix}tool_choice {said} constrains "
                                 f"the output to tool calls, and {prefix}{name})")


@pytest.mark.parametrize("shape", CHAT_SHAPES)
@pytest.mark.parametrize("fields, message", [  # {p}: where the line's fields are ("" or "body.")
    ({"tools": "get_weather"},
     '{p}tools must be a list of {{"type": "function", "function": {{...}}}} objects, got a string'),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}]},
     "{p}tools[1].function.name must be a non-empty string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "{p}tools[0].function.parameters must be a JSON schema (an object), got a list"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"},
     '{p}tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
     "got 'sometimes'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}},
     "{p}tool_choice.function.name 'now' is not one of {p}tools (get_weather)"),
    ({"tool_choice": "required"},
     "{p}tool_choice='required' needs tools to choose from: give {p}tools (a non-empty list)"),
    ({"tools": [WEATHER], "parallel_tool_calls": 0}, "{p}parallel_tool_calls must be true or false, got a number (0)"),
])
def test_bad_tool_fields_are_the_lines_error_naming_the_field(shape, fields, message):
    r = parse(tool_line(shape, fields))
    assert isinstance(r, LineError) and r.kind == INVALID_REQUEST and r.id == "a", r
    assert r.message == message.format(p="" if shape == "native" else "body.")


@pytest.mark.parametrize("shape", CHAT_SHAPES)
def test_tool_turns_in_the_conversation(shape):
    """An assistant turn with tool calls (content null, arguments as JSON text) and the tool's result are taken as
    vLLM renders them; a bad one is the line's error, naming where it is."""
    prefix = "" if shape == "native" else "body."
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    convo = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = parse(tool_line(shape, {"tools": [WEATHER]}, convo))
    assert isinstance(r, Request), r
    assert r.messages[1] == {"role": "assistant", "content": "",
                             "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert r.messages[2] == convo[2]
    r = parse(tool_line(shape, {}, convo))  # a history with tool turns needs no tools to continue it
    assert isinstance(r, Request) and r.tools is None and r.messages[1]["content"] == ""
    bad = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        call, {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{city: Paris}"}}]}]
    r = parse(tool_line(shape, {"tools": [WEATHER]}, bad))
    assert isinstance(r, LineError), r
    assert r.message.startswith(f"{prefix}messages[1].tool_calls[1].function.arguments is not valid JSON")
    r = parse(tool_line(shape, {}, [*USER, {"role": "tool", "tool_call_id": 7, "content": "x"}]))
    assert isinstance(r, LineError) and r.message == f"{prefix}messages[1].tool_call_id must be a string, got a number (7)"


@pytest.mark.parametrize("key, value", [("prompt", "Weather?"), ("prompt_token_ids", [1, 2, 3])])
def test_a_native_prompt_line_cannot_offer_tools(key, value):
    r = parse({"id": "a", key: value, "tools": [WEATHER], "tool_choice": "none"})
    assert isinstance(r, LineError) and r.kind == INVALID_REQUEST
    assert r.message.startswith(f'tools need "messages": a {key} line cannot call tools')
    assert isinstance(parse({"id": "a", key: value, "tools": [], "tool_choice": "none"}), Request)


def test_completions_take_no_tools():
    for fields in ({"tools": [WEATHER]}, {"tool_choice": "auto"}):
        r = parse({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", **fields}})
        assert isinstance(r, LineError) and "tool calling is served on /v1/chat/completions only" in r.message, r
    r = parse({"custom_id": "a", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "x", "tools": [], "tool_choice": "none", "parallel_tool_calls": True}})
    assert isinstance(r, Request) and r.tools is None


def test_unknown_fields_are_named_whole_the_envelope_s_too():
    warned: list[str] = []
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "extra": 1,
            "body": {"prompt": "x", "max_token": 3}}
    assert isinstance(parse_line(json.dumps(line), 0, Defaults(), warned.append), Request)
    assert warned == ["ignoring unknown field 'extra'", "ignoring unknown field 'body.max_token'"]


def test_a_lines_priority_is_read_native_at_the_top_and_openai_in_the_body():
    """vLLM's priority (an integer, lower first): a native line's own field, an OpenAI batch line's body field (vLLM's
    server takes it there). Left out or null it is 0; 2.0 reads as 2, as the sampling integers do."""
    assert parse({"prompt": "x", "priority": -3}).priority == -3
    assert parse({"prompt": "x", "priority": 2.0}).priority == 2
    assert parse({"prompt": "x"}).priority == parse({"prompt": "x", "priority": None}).priority == 0
    warned: list[str] = []
    chat = parse({"custom_id": "c", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "hi"}], "priority": 7}}, warn=warned.append)
    done = parse({"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "hi", "priority": 1}})
    assert (chat.priority, done.priority, warned) == (7, 1, [])


@pytest.mark.parametrize("value", ["1", True, 1.5, [1], {"p": 1}])
def test_a_priority_that_is_not_an_integer_is_the_lines_error(value):
    r = parse({"id": "a", "prompt": "x", "priority": value})
    assert isinstance(r, LineError) and r.kind == INVALID_REQUEST and r.id == "a"
    assert r.message.startswith("priority must be an integer (lower is served first), got ")
    r = parse({"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "hi", "priority": value}})
    assert isinstance(r, LineError) and r.message.startswith("body.priority must be an integer")
