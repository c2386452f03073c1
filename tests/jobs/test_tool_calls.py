"""nvcli/jobs/tool_calls.py: the tools a line offers, the constraints of "required" and named choices, the parsers of
the calls in a completion (on outputs shaped like Qwen3's and Llama 3's), and the real Qwen3 template's rendering."""

from __future__ import annotations

import copy
import json
import re
from types import SimpleNamespace

import pytest

from nvcli.jobs.tool_calls import (
    AUTO,
    HERMES,
    LLAMA3_JSON,
    NAMED,
    NONE,
    QWEN3_CODER,
    REQUIRED,
    ToolCallError,
    ToolSpec,
    extract,
    named_schema,
    parse_hermes,
    parse_llama3_json,
    parse_qwen3_coder,
    parse_tools,
    renders_tools,
    required_schema,
    resolve_parser,
    serving_problem,
    template_message,
    template_text,
)

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                  "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments as a value) of each OpenAI tool call, after checking its shape."""
    out = []
    for c in calls:
        assert set(c) == {"id", "type", "function"} and c["type"] == "function" and CALL_ID.fullmatch(c["id"]), c
        assert isinstance(c["function"]["arguments"], str)
        out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
    return out


# -- hermes (Qwen2.5 / Qwen3 / Hermes) --------------------------------------------------------------------------------
QWEN3_TWO_CALLS = (
    "<think>\nThe user wants the weather in two cities. I'll call get_weather twice.\n</think>\n\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"London\"}}\n</tool_call>"
)


def test_hermes_finds_every_call_and_the_text_before_them():
    content, calls = parse_hermes(QWEN3_TWO_CALLS)
    assert content == ("<think>\nThe user wants the weather in two cities. I'll call get_weather twice.\n"
                       "</think>\n\n")
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_weather", {"city": "London"})]
    assert calls[0]["id"] != calls[1]["id"]


def test_hermes_content_is_null_when_the_calls_lead():
    content, calls = parse_hermes("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>")
    assert content is None and calls_of(calls) == [("now", {})]
    assert calls[0]["function"]["arguments"] == "{}"


def test_hermes_reads_an_unclosed_last_block():
    """A completion cut by a stop string or max_tokens right after the JSON: the last block has no </tool_call>."""
    text = ("Let me check.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n")
    content, calls = parse_hermes(text)
    assert content == "Let me check.\n"
    assert calls_of(calls) == [("now", {}), ("get_weather", {"city": "Oslo"})]


def test_hermes_text_without_calls_is_content():
    assert parse_hermes("The weather in Paris is sunny.") == ("The weather in Paris is sunny.", [])
    assert parse_hermes("") == ("", [])


@pytest.mark.parametrize("block", [
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",  # cut mid-JSON
    "{'name': 'now', 'arguments': {}}",  # not JSON
    "",  # empty
    "{\"arguments\": {}}",  # no name
    "{\"name\": 3, \"arguments\": {}}",  # a name that is not a string
    "{\"name\": \"\", \"arguments\": {}}",
    "{\"name\": \"now\"}",  # no arguments (vLLM's parser fails on these too)
    "{\"name\": \"now\", \"arguments\": [1, 2]}",  # arguments that are not an object
    "{\"name\": \"now\", \"arguments\": 7}",
    "{\"name\": \"now\", \"arguments\": null}",
    "{\"name\": \"now\", \"arguments\": \"not json\"}",
    "[{\"name\": \"now\", \"arguments\": {}}]",
])
def test_hermes_one_bad_block_means_no_calls_and_the_whole_text_as_content(block):
    text = f"Sure.\n<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>\n<tool_call>\n{block}\n</tool_call>"
    assert parse_hermes(text) == (text, [])


def test_hermes_arguments_given_as_json_text_of_an_object_are_taken():
    """Some fine-tunes quote the arguments; the JSON text of an object is read as that object (vLLM would answer
    arguments that are a JSON string literal, which no client can use)."""
    _, calls = parse_hermes("<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}"
                            "</tool_call>")
    assert calls_of(calls) == [("get_weather", {"city": "Rome"})]


def test_unicode_arguments_stay_unescaped():
    _, calls = parse_hermes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", "
                            "\"note\": \"晴れ 🌞\"}}\n</tool_call>")
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich", "note": "晴れ 🌞"}'
    _, calls = parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Kraków"}}')
    assert calls[0]["function"]["arguments"] == '{"city": "Kraków"}'


# -- llama3_json (Llama 3.1 / 3.2) ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('{"name": "now", "arguments": {}}', [("now", {})]),
    ('{"name": "now", "parameters": {}, "arguments": {"a": 1}}', [("now", {"a": 1})]),  # vLLM's: arguments first
    ('\n {"name": "now", "parameters": {}}\n', [("now", {})]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ('<|python_tag|>{"name": "now", "parameters": {}};{"name": "get_weather", "parameters": {"city": "Oslo"}};',
     [("now", {}), ("get_weather", {"city": "Oslo"})]),
])
def test_llama3_json_reads_one_or_more_calls(text, expected):
    content, calls = parse_llama3_json(text)
    assert content is None and calls_of(calls) == expected


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    'Here you go: {"name": "now", "parameters": {}}',  # text first: an answer, not a call
    '{"answer": 42}',  # JSON the user asked for, not a call
    '{"name": "Bob", "age": 3}',  # a name but neither parameters nor arguments
    '{"name": "now", "parameters": [1]}',
    '{"name": "now", "parameters": {}} and then some text',
    '{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Pa',  # cut short
    '<|python_tag|>',
    "",
])
def test_llama3_json_anything_else_is_content(text):
    assert parse_llama3_json(text) == (text, [])


# -- the request --------------------------------------------------------------------------------------------------------
def test_tools_default_to_auto_and_parallel():
    spec = parse_tools({"tools": TOOLS})
    assert (spec.tools, spec.choice, spec.name, spec.parallel, spec.parser) == (TOOLS, AUTO, None, True, None)
    assert spec.schema() is None


@pytest.mark.parametrize("fields, choice, name, parallel", [
    ({"tool_choice": "none"}, NONE, None, True),
    ({"tool_choice": "auto", "parallel_tool_calls": False}, AUTO, None, False),
    ({"tool_choice": "required", "parallel_tool_calls": None}, REQUIRED, None, True),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, NAMED, "now", True),
    ({"tool_choice": {"function": {"name": "get_weather"}}}, NAMED, "get_weather", True),
])
def test_tool_choice_forms(fields, choice, name, parallel):
    spec = parse_tools({"tools": TOOLS, **fields})
    assert (spec.choice, spec.name, spec.parallel) == (choice, name, parallel)


@pytest.mark.parametrize("obj", [{}, {"tools": None}, {"tools": []}, {"tools": [], "tool_choice": "none"},
                                 {"tool_choice": "none"}, {"tool_choice": None, "parallel_tool_calls": True}])
def test_no_tools(obj):
    assert parse_tools(obj, "body.") is None


@pytest.mark.parametrize("obj, message", [
    ({"tools": {"type": "function"}},
     'body.tools must be a list of {"type": "function", "function": {...}} objects, got an object'),
    ({"tools": [WEATHER, "now"]}, 'body.tools[1] must be an object {"type": "function", "function": {...}}, got a string'),
    ({"tools": [{"type": "code_interpreter"}]},
     "body.tools[0].type must be \"function\" (the only kind of tool nv serves), got 'code_interpreter'"),
    ({"tools": [{"type": "function"}]},
     'body.tools[0].function must be an object {"name", "description", "parameters"}, got null'),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}]},
     "body.tools[1].function.name must be a non-empty string"),
    ({"tools": [WEATHER, {"type": "function", "function": {"description": "x"}}]},
     "body.tools[1].function.name must be a non-empty string"),
    ({"tools": [{"type": "function", "function": {"name": "a", "description": 3}}]},
     "body.tools[0].function.description must be a string, got a number (3)"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": "{}"}}]},
     "body.tools[0].function.parameters must be a JSON schema (an object), got a string"),
    ({"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]},
     "body.tools[0].function.strict must be true or false, got a string"),
    ({"tools": TOOLS, "tool_choice": "any"},
     'body.tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
     "got 'any'"),
    ({"tools": TOOLS, "tool_choice": True},
     'body.tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
     "got True"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "body.tool_choice.function.name 'get_time' is not one of body.tools (get_weather, now)"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
     "body.tool_choice.function.name must be a non-empty string"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "now"}},
     'body.tool_choice.function must be an object {"name": ...}, got null'),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "now"}}},
     "body.tool_choice.type must be \"function\", got 'tool'"),
    ({"tool_choice": "auto"}, "body.tool_choice='auto' needs tools to choose from: give body.tools (a non-empty list)"),
    ({"tools": [], "tool_choice": "required"},
     "body.tool_choice='required' needs tools to choose from: give body.tools (a non-empty list)"),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}},
     "body.tool_choice={'type': 'function', 'function': {'name': 'now'}} needs tools to choose from: give body.tools "
     "(a non-empty list)"),
    ({"tools": TOOLS, "parallel_tool_calls": "false"}, "body.parallel_tool_calls must be true or false, got a string"),
])
def test_every_bad_field_is_named(obj, message):
    with pytest.raises(ToolCallError) as e:
        parse_tools(obj, "body.")
    assert str(e.value) == message


# -- the constraints --------------------------------------------------------------------------------------------------
def test_required_schema_is_vllms():
    assert required_schema(TOOLS) == {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER_PARAMS},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
             "required": ["name", "parameters"]},
        ]},
    }
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    assert "maxItems" not in required_schema(TOOLS, parallel=True)
    assert parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).schema() == \
        required_schema(TOOLS, parallel=False)


def test_required_schema_lifts_the_tools_defs_to_the_top_without_touching_the_tools():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    a = {"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}}}
    b = {"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"q": {"$ref": "#/$defs/Point"}, "t": {"$ref": "#/$defs/Tag"}},
        "$defs": {"Point": point, "Tag": {"type": "string"}}}}}
    tools = [a, b]
    before = copy.deepcopy(tools)
    schema = required_schema(tools)
    assert schema["$defs"] == {"Point": point, "Tag": {"type": "string"}}
    assert all("$defs" not in branch["properties"]["parameters"] for branch in schema["items"]["anyOf"])
    assert tools == before
    b["function"]["parameters"]["$defs"]["Point"] = {"type": "string"}
    with pytest.raises(ToolCallError, match=r"tools\[1\]\.function\.parameters\.\$defs\.Point differs"):
        parse_tools({"tools": tools, "tool_choice": "required"})
    assert parse_tools({"tools": tools, "tool_choice": "auto"}).choice == AUTO  # only "required" merges them


def test_named_schema_is_the_functions_parameters():
    assert named_schema(TOOLS, "get_weather") == WEATHER_PARAMS
    assert named_schema(TOOLS, "now") == {"type": "object", "properties": {}, "additionalProperties": False}
    spec = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert spec.schema() == WEATHER_PARAMS


def test_the_constraints_compile():
    """llguidance takes both schemas (what the engine will compile for the line)."""
    pytest.importorskip("llguidance")
    from nvcli.engine.structured_output import constraint_problem
    from nvcli.sampling_params import StructuredOutputsParams

    for schema in (required_schema(TOOLS), required_schema(TOOLS, parallel=False), named_schema(TOOLS, "now")):
        assert constraint_problem(StructuredOutputsParams(json=schema)) is None


# -- the answer -------------------------------------------------------------------------------------------------------
def spec(choice: str, **kw) -> ToolSpec:
    return ToolSpec(TOOLS, choice, **kw)


def test_extract_auto_with_and_without_calls():
    got = extract(spec(AUTO, parser=HERMES), QWEN3_TWO_CALLS, "stop")
    assert got.finish_reason == "tool_calls" and len(got.calls) == 2 and got.content.startswith("<think>")
    got = extract(spec(AUTO, parser=HERMES, parallel=False), QWEN3_TWO_CALLS, "stop")
    assert calls_of(got.calls) == [("get_weather", {"city": "Paris", "unit": "c"})]  # the first only
    got = extract(spec(AUTO, parser=HERMES), "It is sunny.", "stop")
    assert (got.content, got.calls, got.finish_reason) == ("It is sunny.", [], "stop")
    got = extract(spec(AUTO, parser=LLAMA3_JSON), '{"name": "now", "parameters": {}}', "stop")
    assert (got.content, calls_of(got.calls), got.finish_reason) == (None, [("now", {})], "tool_calls")
    got = extract(spec(AUTO, parser=HERMES), "<tool_call>\n{\"name\": \"now\", \"argu", "length")
    assert (got.content, got.calls, got.finish_reason) == ("<tool_call>\n{\"name\": \"now\", \"argu", [], "length")


def test_extract_none_leaves_the_text_alone():
    got = extract(spec(NONE), QWEN3_TWO_CALLS, "stop")
    assert (got.content, got.calls, got.finish_reason) == (QWEN3_TWO_CALLS, [], "stop")


def test_extract_required():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    got = extract(spec(REQUIRED), text, "stop")
    assert (got.content, got.finish_reason) == ("", "tool_calls")
    assert calls_of(got.calls) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert got.calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # json.dumps of the parameters
    cut = '[{"name": "get_weather", "parameters": {"city": "Par'
    got = extract(spec(REQUIRED), cut, "length")
    assert (got.content, got.calls, got.finish_reason) == (cut, [], "length")


def test_extract_named():
    got = extract(spec(NAMED, name="get_weather"), '{"city": "Paris"}', "stop")
    assert (got.content, got.finish_reason) == ("", "stop")  # vLLM keeps the engine's finish_reason here
    assert got.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}  # the text itself
    got = extract(spec(NAMED, name="get_weather"), '{"city": "Pa', "length")
    assert (got.content, got.calls, got.finish_reason) == ('{"city": "Pa', [], "length")


# -- the conversation -------------------------------------------------------------------------------------------------
def test_template_message_as_vllm_renders_it():
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}},
        {"id": "call_3", "type": "function", "function": {"name": "now", "arguments": {"already": "a dict"}}},
    ]}
    out = template_message(turn, "messages[1]")
    assert out["content"] == ""
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == [{"city": "Paris"}, {}, {"already": "a dict"}]
    assert out["tool_calls"][0]["id"] == "call_1"
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the line's own object is untouched
    assert template_message({"role": "tool", "tool_call_id": "call_1", "content": None}, "m") == \
        {"role": "tool", "tool_call_id": "call_1", "content": ""}
    plain = {"role": "user", "content": "hi"}
    assert template_message(plain, "m") is plain


@pytest.mark.parametrize("calls, message", [
    ("x", 'messages[1].tool_calls must be a list of {"id", "type": "function", "function": {"name", "arguments"}} '
          "objects, got a string"),
    ([3], 'messages[1].tool_calls[0] must be an object {"id", "type": "function", "function": {...}}, got a number (3)'),
    ([{"id": "c"}], 'messages[1].tool_calls[0].function must be an object {"name", "arguments"}, got null'),
    ([{"function": {"arguments": "{}"}}], "messages[1].tool_calls[0].function.name must be a non-empty string"),
    ([{"function": {"name": "now", "arguments": "{}"}}, {"function": {"name": "now", "arguments": "{'a': 1}"}}],
     "messages[1].tool_calls[1].function.arguments is not valid JSON: "),
    ([{"function": {"name": "now", "arguments": 5}}],
     "messages[1].tool_calls[0].function.arguments must be a JSON object as a string, got a number (5)"),
])
def test_a_bad_tool_call_turn_is_named(calls, message):
    with pytest.raises(ToolCallError) as e:
        template_message({"role": "assistant", "content": None, "tool_calls": calls}, "messages[1]")
    assert str(e.value).startswith(message)


# -- the model's template -------------------------------------------------------------------------------------------
LLAMA31_LIKE = ('{%- if tools %}Given the following functions, please respond with a JSON for a function call with '
                'its proper arguments{% endif %}{%- if builtin_tools %}<|python_tag|>{% endif %}')


# the tool-call instructions of Qwen3-Coder's and Qwen3.5's chat templates, in short
QWEN35_LIKE = ("{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\nTo call a "
               "function reply with:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
               "\nvalue_1\n</parameter>\n</function>\n</tool_call>{% endif %}")
TYPED = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
    "breakfast": {"type": "boolean"}, "guests": {"type": "array"}, "prefs": {"type": "object"},
    "floor": {"type": ["integer", "null"]}, "note": {"enum": ["quiet", "view"]}, "when": {"type": "date"}}}}}
XML_CALLS = ("I will book it.\n<tool_call>\n<function=book>\n<parameter=city>\nSão Paulo\n</parameter>\n"
             "<parameter=nights>\n3\n</parameter>\n<parameter=budget>\n250.5\n</parameter>\n<parameter=breakfast>\n"
             "True\n</parameter>\n<parameter=guests>\n[\"ana\", \"bo\"]\n</parameter>\n<parameter=prefs>\n"
             "{'quiet': true}\n</parameter>\n<parameter=floor>\nnull\n</parameter>\n<parameter=note>\nview\n"
             "</parameter>\n<parameter=code>\nif a < b:\n    print(\"x\")\n\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=now>\n</function>\n</tool_call>")


def test_qwen3_coder_reads_each_call_with_values_typed_by_the_schema():
    content, calls = parse_qwen3_coder(XML_CALLS, [TYPED, NOW])
    assert content == "I will book it.\n"
    assert calls_of(calls) == [("book", {"city": "São Paulo", "nights": 3, "budget": 250.5, "breakfast": True,
                                         "guests": ["ana", "bo"], "prefs": "{'quiet': true}", "floor": None,
                                         "note": "view", "code": 'if a < b:\n    print("x")\n'}),
                               ("now", {})]
    assert "São Paulo" in calls[0]["function"]["arguments"]  # not escaped, as vLLM's json.dumps(ensure_ascii=False)


@pytest.mark.parametrize("kind, text, value", [
    ("integer", "42", 42), ("integer", "4.5", "4.5"), ("integer", "many", "many"),
    ("number", "2.0", 2), ("number", "1e400", "1e400"), ("number", "nan", "nan"),
    ("boolean", "FALSE", False), ("boolean", "yes", False), ("boolean", "NULL", None),
    ("object", '{"a": [1, 2]}', {"a": [1, 2]}), ("object", "{'a': True}", {"a": True}), ("array", "[1,", "[1,"),
    ("array", "{1, 2}", "{1, 2}"),  # a Python set is no JSON value
    ("date", "2026-11-24", "2026-11-24"), ("tuple", "(1, 2)", [1, 2]), ("string", "123", "123")])
def test_qwen3_coder_value_conversions(kind: str, text: str, value) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"p": {"type": kind}}}}}
    _, calls = parse_qwen3_coder(f"<tool_call>\n<function=f>\n<parameter=p>\n{text}\n</parameter>\n</function>",
                                 [tool])
    assert calls_of(calls) == [("f", {"p": value})]


def test_qwen3_coder_unclosed_and_untagged_calls():
    # cut short: the last parameter runs to the end
    content, calls = parse_qwen3_coder("<tool_call>\n<function=book>\n<parameter=nights>\n2", [TYPED])
    assert (content, calls_of(calls)) == (None, [("book", {"nights": 2})])
    # parameters closed by the next one or by </function>; no <tool_call> block at all: the whole text is read
    content, calls = parse_qwen3_coder("Sure. <function=book><parameter=city>Oslo<parameter=nights>1</function>", [TYPED])
    assert (content, calls_of(calls)) == ("Sure. ", [("book", {"city": "Oslo", "nights": 1})])
    # a parameter the tool does not define, of a tool not offered: text
    assert calls_of(parse_qwen3_coder("<function=other>\n<parameter=n>\n7\n</parameter>", [TYPED])[1]) == \
        [("other", {"n": "7"})]


@pytest.mark.parametrize("text", ["It is sunny.", "<tool_call>\n{\"name\": \"now\"}\n</tool_call>",
                                  "<tool_call>\n<function=book\n</tool_call>", "<function=>x</function>",
                                  "<function=book>\n<parameter=city\n</function>"])
def test_qwen3_coder_without_a_readable_call_is_all_content(text: str) -> None:
    assert parse_qwen3_coder(text, [TYPED]) == (text, [])


def test_extract_auto_with_the_xml_parser():
    got = extract(ToolSpec([TYPED, NOW], AUTO, parser=QWEN3_CODER), XML_CALLS, "stop")
    assert (got.content, got.finish_reason, [c["function"]["name"] for c in got.calls]) == \
        ("I will book it.\n", "tool_calls", ["book", "now"])
    got = extract(ToolSpec([TYPED, NOW], AUTO, parallel=False, parser=QWEN3_CODER), XML_CALLS, "stop")
    assert [c["function"]["name"] for c in got.calls] == ["book"]


def test_the_parser_from_the_template_and_the_flag():
    assert resolve_parser("auto", "{% if tools %}<tool_call>{% endif %}") == HERMES
    assert resolve_parser("auto", LLAMA31_LIKE) == LLAMA3_JSON
    assert resolve_parser("auto", "{% if tools %}Given the following functions, please respond with a JSON for a "
                                  "function call{% endif %}") == LLAMA3_JSON  # Llama 3.2's, without the tag
    assert resolve_parser("auto", "{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert resolve_parser("auto", None) is None
    assert resolve_parser("llama3_json", "<tool_call>") == LLAMA3_JSON
    assert resolve_parser("hermes", None) == HERMES
    # Qwen3-Coder / Qwen3.5 templates show <tool_call> too: the XML format's own mark wins
    assert resolve_parser("auto", QWEN35_LIKE) == QWEN3_CODER
    assert resolve_parser("qwen3_xml", None) == QWEN3_CODER  # vLLM's other name for it


def test_what_stops_a_line_with_tools():
    assert "does not render tools" in serving_problem(spec(REQUIRED), "{{ messages }}")
    assert "does not render tools" in serving_problem(spec(AUTO, parser=HERMES), None)
    assert "pass --tool-call-parser hermes, llama3_json or qwen3_coder" in serving_problem(spec(AUTO), "{{ tools }}")
    assert serving_problem(spec(REQUIRED), "{{ tools }}") is None
    assert serving_problem(spec(AUTO, parser=HERMES), "{{ tools }}") is None
    assert renders_tools("{{ tools }}") and not renders_tools("{{ messages }}")


def test_the_template_a_line_uses():
    tok = SimpleNamespace(chat_template="mine")
    assert template_text(tok) == "mine"
    assert template_text(tok, {"chat_template": "the line's"}) == "the line's"
    assert template_text(SimpleNamespace(chat_template={"default": "a", "tool_use": "b {{ tools }}"})) == \
        "a\nb {{ tools }}"
    assert template_text(SimpleNamespace()) is None


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    from nvcli.models.tokenizer import load_tokenizer
    from nvcli.testing.tiny_models import qwen_tokenizer_dir

    return load_tokenizer(qwen_tokenizer_dir())


def render(tokenizer, messages, tools=None, **kwargs) -> str:
    """The engine's own render_chat_text, on the real tokenizer (no model needed)."""
    from nvcli.engine.llm_engine import LLMEngine

    return LLMEngine.render_chat_text(SimpleNamespace(tokenizer=tokenizer), messages, kwargs or None, tools=tools)  # type: ignore[arg-type]


def test_qwen3s_template_renders_the_tools_and_a_tool_call_round_trip(qwen3_tokenizer):
    """A conversation as an OpenAI client sends it after one round of tools (the assistant's turn has content null
    and its arguments as JSON text, then the tool's result) renders as Qwen3 was trained on, and the template's
    format is the one the hermes parser reads."""
    from nvcli.jobs.requests import Defaults, Request, parse_line

    line = {"custom_id": "t", "method": "POST", "url": "/v1/chat/completions", "body": {
        "tools": [WEATHER],
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        ]}}
    req = parse_line(json.dumps(line), 0, Defaults())
    assert isinstance(req, Request), req
    text = render(qwen3_tokenizer, req.messages, req.tools.tools, enable_thinking=False)
    assert text == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False) +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", "
        "\"unit\": \"c\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # the model's earlier turn, as the template wrote it, is what the parser reads back
    turn = text.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                                                                 "{\"temp\": 21}\n</tool_response><|im_end|>\n")
    content, calls = parse_hermes(turn)
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Zürich", "unit": "c"})]
    template = template_text(qwen3_tokenizer)
    assert renders_tools(template) and resolve_parser("auto", template) == HERMES


def test_qwen3s_template_with_tool_choice_none_still_offers_the_tools(qwen3_tokenizer):
    """vLLM renders the tools whatever the choice; without tools the prompt is the plain one."""
    msgs = [{"role": "user", "content": "hi"}]
    with_tools = render(qwen3_tokenizer, msgs, parse_tools({"tools": [NOW], "tool_choice": "none"}).tools)
    assert with_tools.startswith("<|im_start|>system\n# Tools") and '"name": "now"' in with_tools
    assert render(qwen3_tokenizer, msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
