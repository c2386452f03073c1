"""Tool calling, as vLLM's OpenAI server does it (`--enable-auto-tool-choice --tool-call-parser ...`).

A chat line offers functions in `tools` and says in `tool_choice` whether the model may call them:
- "none": the tools are rendered into the prompt (vLLM's default), the answer is text;
- "auto" (the default when tools are given): the model answers freely and the job's parser finds the calls in the
  text (`hermes`: `<tool_call>{...}</tool_call>` blocks, Qwen2.5/Qwen3/Hermes; `llama3_json`: `{...}; {...}` JSON,
  Llama 3.1/3.2; `qwen3_coder`: `<tool_call><function=name><parameter=key>value</parameter></function></tool_call>`,
  Qwen3-Coder/Qwen3.5, each value read by its parameter's type in the tool's schema);
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` calls of the given tools;
- `{"type": "function", "function": {"name": ...}}`: the output is constrained to that function's parameters.

This module validates those fields (`parse_tools`) and the tool-call turns of a conversation (`template_message`),
builds the constraint of "required" and named choices (`ToolSpec.schema`), and turns a completion's text into
OpenAI tool calls (`extract`). It knows nothing of the engine or of the output line's shape.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from nvcli.jobs.jsonio import json_type

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
QWEN3_CODER = "qwen3_coder"
PARSERS = (HERMES, LLAMA3_JSON, QWEN3_CODER)
PARSER_ALIASES = {"qwen3_xml": QWEN3_CODER}  # vLLM's second parser of the XML format reads it the same
PARSER_CHOICES = ("auto", *PARSERS, *PARSER_ALIASES)  # --tool-call-parser

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
# vLLM means "an empty object" (its default grammar backend, xgrammar, reads a schema strictly); llguidance reads
# the JSON Schema standard, where unnamed properties are allowed unless said otherwise
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM's Hermes2ProToolParser
_HERMES_START = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# the XML format (vLLM's Qwen3CoderToolParser): a function runs to </function> or the end, a parameter to
# </parameter>, the next parameter, </function> or the end
_XML_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_XML_START = "<function="
# what marks a chat template's tool-call format (--tool-call-parser auto), first match wins: the XML format's templates
# also show <tool_call>; Llama 3.2's JSON instruction has no tag
_TEMPLATE_MARKS = ((QWEN3_CODER, ("<parameter=",)),
                   (HERMES, (_HERMES_START,)),
                   (LLAMA3_JSON, (_PYTHON_TAG, "respond with a JSON for a function call")))


class ToolCallError(ValueError):
    """A line's tools, tool_choice or tool-call turn that cannot be served; the message names the field."""


@dataclass
class ToolSpec:
    """The tools a line offers and what it lets the model do with them."""

    tools: list[dict[str, Any]]  # validated, as the line gave them: the chat template renders these
    choice: str  # NONE | AUTO | REQUIRED | NAMED
    name: str | None = None  # NAMED: the function
    parallel: bool = True  # parallel_tool_calls
    parser: str | None = None  # AUTO: the job's parser (one of PARSERS), set when the line is rendered

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match (vLLM's `_get_json_schema_from_tool`), or None (NONE, AUTO)."""
        if self.choice == NAMED:
            return named_schema(self.tools, self.name or "")
        if self.choice == REQUIRED:
            return required_schema(self.tools, self.parallel)
        return None


@dataclass
class Extracted:
    """A completion read for tool calls: the message's content, its calls (OpenAI objects) and finish_reason."""

    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


# -- the request ----------------------------------------------------------------------------------------------------
def parse_tools(obj: dict[str, Any], prefix: str = "") -> ToolSpec | None:
    """The line's `tools`, `tool_choice` and `parallel_tool_calls` (`prefix` is "body." in an OpenAI request); None
    when it offers no tools (none given, or an empty list). ToolCallError names the field that is wrong."""
    tools = _tools(obj.get("tools"), prefix + "tools")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolCallError(f"{prefix}parallel_tool_calls must be true or false, got {json_type(parallel)}")
    raw = obj.get("tool_choice")
    where = prefix + "tool_choice"
    if raw is None:
        choice, name = AUTO, None  # vLLM's default when tools are given
    elif raw in (NONE, AUTO, REQUIRED):
        choice, name = raw, None
    elif isinstance(raw, dict):
        choice, name = NAMED, _named_choice(raw, where)
    else:
        raise ToolCallError(f"{where} must be \"none\", \"auto\", \"required\" or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {raw!r}")
    if not tools:
        if raw is None or raw == NONE:
            return None
        raise ToolCallError(f"{where}={raw!r} needs tools to choose from: give {prefix}tools (a non-empty list)")
    if name is not None:
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise ToolCallError(f"{where}.function.name {name!r} is not one of {prefix}tools ({', '.join(names)})")
    spec = ToolSpec(tools, choice, name, parallel is not False)
    if choice == REQUIRED:
        required_schema(tools, spec.parallel, prefix + "tools")  # conflicting $defs are this line's error
    return spec


def _tools(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolCallError(f"{where} must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects, "
                            f"got {json_type(value)}")
    for i, tool in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict):
            raise ToolCallError(f"{at} must be an object {{\"type\": \"function\", \"function\": {{...}}}}, "
                                f"got {json_type(tool)}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ToolCallError(f"{at}.type must be \"function\" (the only kind of tool nv serves), got {kind!r}")
        fn = _function(tool, at, '{"name", "description", "parameters"}')
        for key, ok, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema (an object)"),
                              ("strict", bool, "true or false")):
            if fn.get(key) is not None and not isinstance(fn[key], ok):
                raise ToolCallError(f"{at}.function.{key} must be {what}, got {json_type(fn[key])}")
    return value


def _named_choice(value: dict[str, Any], where: str) -> str:
    kind = value.get("type", "function")
    if kind != "function":
        raise ToolCallError(f"{where}.type must be \"function\", got {kind!r}")
    return _function(value, where, '{"name": ...}')["name"]


def _function(holder: dict[str, Any], where: str, fields: str) -> dict[str, Any]:
    """`holder["function"]`: an object (`fields` says which keys) with a non-empty string name."""
    fn = holder.get("function")
    if not isinstance(fn, dict):
        raise ToolCallError(f"{where}.function must be an object {fields}, got {json_type(fn)}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolCallError(f"{where}.function.name must be a non-empty string")
    return fn


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """A named tool_choice: the output is that function's arguments, a JSON value of its parameters' schema."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"].get("parameters") or dict(_EMPTY_PARAMETERS)
    raise ToolCallError(f"tool_choice names {name!r}, which is not one of the tools")


def required_schema(tools: list[dict[str, Any]], parallel: bool = True, where: str = "tools") -> dict[str, Any]:
    """tool_choice "required": a JSON array of at least one (with parallel false: exactly one) call
    `{"name": one of the tools, "parameters": its arguments}`. The tools' `$defs` move to the top, where their
    `#/$defs/...` references find them (vLLM's); two tools that define one name differently are a ToolCallError."""
    defs: dict[str, Any] = {}
    choices = []
    for i, tool in enumerate(tools):
        params = copy.deepcopy(tool["function"].get("parameters")) or dict(_EMPTY_PARAMETERS)
        for def_name, def_schema in (params.pop("$defs", None) or {}).items():
            if def_name in defs and defs[def_name] != def_schema:
                raise ToolCallError(f"{where}[{i}].function.parameters.$defs.{def_name} differs from another tool's "
                                    "definition of that name: tool_choice \"required\" needs one schema per name")
            defs[def_name] = def_schema
        choices.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                       "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    schema["items"] = {"type": "object", "anyOf": choices}
    if defs:
        schema["$defs"] = defs
    return schema


def template_message(message: dict[str, Any], where: str) -> dict[str, Any]:
    """A message as chat templates expect it (vLLM's): null content as "" (Qwen3's template cannot take None), and
    an assistant's tool calls with their JSON `arguments` text parsed into a value. `where` names the message."""
    out = message
    if message.get("content") is None:
        out = {**message, "content": ""}
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls is not None:
        out = {**out, "tool_calls": _turn_calls(calls, where + ".tool_calls")}
    return out


def _turn_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ToolCallError(f"{where} must be a list of {{\"id\", \"type\": \"function\", \"function\": "
                            f"{{\"name\", \"arguments\"}}}} objects, got {json_type(calls)}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ToolCallError(f"{at} must be an object {{\"id\", \"type\": \"function\", \"function\": {{...}}}}, "
                                f"got {json_type(call)}")
        fn = _function(call, at, '{"name", "arguments"}')
        args = fn.get("arguments")
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                raise ToolCallError(f"{at}.function.arguments is not valid JSON: {e}") from None
        elif not isinstance(args, (dict, list)):
            raise ToolCallError(f"{at}.function.arguments must be a JSON object as a string, got {json_type(args)}")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


# -- the model and its template -------------------------------------------------------------------------------------
def template_text(tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> str | None:
    """The chat template a line is rendered with: its own (`chat_template` in chat_template_kwargs), else the
    tokenizer's (several named templates read as one)."""
    own = (chat_template_kwargs or {}).get("chat_template")
    template = own if isinstance(own, str) else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None


def renders_tools(template: str | None) -> bool:
    """Whether a chat template can render tools at all (it mentions them)."""
    return template is not None and "tools" in template


def resolve_parser(flag: str, template: str | None) -> str | None:
    """--tool-call-parser: the parser named, or for "auto" the one the chat template's format calls for; None when
    the template shows none of the formats nv reads."""
    if flag != "auto":
        return PARSER_ALIASES.get(flag, flag)
    for parser, marks in _TEMPLATE_MARKS:
        if template is not None and any(mark in template for mark in marks):
            return parser
    return None


def serving_problem(spec: ToolSpec, template: str | None) -> str | None:
    """Why a line with tools cannot be served with this template and parser, or None."""
    if not renders_tools(template):
        return "this model's chat template does not render tools: send the line without tools, or use a model " \
               "whose template takes them"
    if spec.choice == AUTO and spec.parser is None:
        return "tool_choice \"auto\" needs a tool-call parser and this model's chat template shows no format nv " \
               "knows: pass --tool-call-parser hermes, llama3_json or qwen3_coder"
    return None


# -- the output -----------------------------------------------------------------------------------------------------
def extract(spec: ToolSpec, text: str, finish_reason: str | None) -> Extracted:
    """The tool calls in one completion, with the message content and finish_reason vLLM answers with."""
    if spec.choice == NONE:
        return Extracted(text, [], finish_reason)
    if spec.choice == NAMED:
        if _parses(text):  # vLLM's arguments are the generated text itself
            return Extracted("", [tool_call(spec.name or "", text)], finish_reason)
        return Extracted(text, [], finish_reason)  # cut short ("length"): not a call
    if spec.choice == REQUIRED:
        calls = _required_calls(text)
        if calls is None:
            return Extracted(text, [], finish_reason)
        return Extracted("", calls, "tool_calls" if finish_reason == "stop" else finish_reason)
    if spec.parser == LLAMA3_JSON:
        content, calls = parse_llama3_json(text)
    elif spec.parser == QWEN3_CODER:
        content, calls = parse_qwen3_coder(text, spec.tools)
    else:
        content, calls = parse_hermes(text)
    if not calls:
        return Extracted(content, [], finish_reason)
    return Extracted(content, calls if spec.parallel else calls[:1], "tool_calls")


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call object, with a fresh id (vLLM's `chatcmpl-tool-<32 hex>`)."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a Hermes-format completion: each `<tool_call>{"name", "arguments"}</tool_call>` block (a
    last one may be unclosed) is a call; the content is the text before the first block, None if that is empty. If
    any block is not such a call, nothing was called and the content is the whole text (vLLM's)."""
    start = text.find(_HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for closed, unclosed in _HERMES_BLOCK.findall(text):
        call = _call(_json(closed or unclosed), "arguments")
        if call is None:
            return text, []
        calls.append(call)
    return text[:start] or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a Llama 3 JSON completion: text that starts with `<|python_tag|>` or `{` and holds
    `{"name", "parameters" | "arguments"}` objects separated by ";"; content None when called. Any other text, or
    one object that is not a call, is content with no calls (vLLM's)."""
    body = text.lstrip()
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call(obj, "arguments" if isinstance(obj, dict) and "arguments" in obj else "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = _skip(body, end)
        if at < len(body):
            if body[at] != ";":
                return text, []
            at = _skip(body, at + 1)
    return None, calls


def parse_qwen3_coder(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a Qwen3-Coder / Qwen3.5 completion, as vLLM's `qwen3_coder` parser reads it: each
    `<function=NAME>` in the `<tool_call>` blocks (a last block or function may be unclosed; without any block, in the
    whole text) is a call, and its `<parameter=KEY>` values (one newline stripped from each end) are read by the
    parameter's type in that tool's schema (`_xml_value`). The content is the text before the first block (or
    function), None if that is empty. A function or parameter without its `>` means nothing was called and the whole
    text is content."""
    if _XML_START not in text:
        return text, []
    blocks = [closed or unclosed for closed, unclosed in _HERMES_BLOCK.findall(text)] or [text]
    functions = [closed or unclosed for block in blocks for closed, unclosed in _XML_FUNCTION.findall(block)]
    calls = []
    for function in functions:
        name, found, body = function.partition(">")
        if not found or not name:
            return text, []
        schemas = _parameter_schemas(tools, name)
        args: dict[str, Any] = {}
        for parameter in _XML_PARAMETER.findall(body):
            key, found, value = parameter.partition(">")
            if not found:
                return text, []
            value = value.removeprefix("\n").removesuffix("\n")
            args[key] = _xml_value(value, schemas.get(key))
        calls.append(tool_call(name, json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text, []
    start = text.find(_HERMES_START)
    start = start if start >= 0 else text.find(_XML_START)
    return text[:start] or None, calls


def _parameter_schemas(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The named tool's parameters' schemas by name ({} for an unknown tool or one without properties)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            params = tool["function"].get("parameters") or {}
            properties = params.get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


_XML_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def _xml_value(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type asks for (vLLM's conversions): "null" (any case) is null;
    a parameter the tool does not define (schema None) and the string types stay text; integer and number types parse
    as such (a whole number as an integer); boolean is whether the text is "true"; objects and arrays parse as JSON,
    any other type as a Python literal. Text that does not parse, or parses to no JSON value, stays text."""
    if text.lower() == "null":
        return None
    if schema is None:
        return text
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if kind in _XML_STRING_TYPES:
        return text
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            value: Any = int(text)
        elif kind.startswith(("num", "float")):
            number = float(text)
            value = int(number) if number.is_integer() else number
        elif kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
            value = _json(text)
            if value is _INVALID:  # vLLM tries a Python literal next ('{"a": True}', single quotes)
                value = ast.literal_eval(text)
        else:
            value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, OverflowError):
        return text
    try:
        json.dumps(value, allow_nan=False)  # NaN, infinity, sets, bytes: no JSON value
    except (TypeError, ValueError, RecursionError):
        return text
    return value


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _call(obj: Any, key: str) -> dict[str, Any] | None:
    """A parsed `{"name": str, key: arguments}` as a tool call; the arguments an object, or the JSON text of one
    (some models quote them). None if it is not such a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"] or key not in obj:
        return None
    args = obj[key]
    if isinstance(args, str):
        args = _json(args)
    if not isinstance(args, dict):
        return None
    return tool_call(obj["name"], json.dumps(args, ensure_ascii=False))


def _required_calls(text: str) -> list[dict[str, Any]] | None:
    items = _json(text)
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(tool_call(item["name"], json.dumps(item.get("parameters"), ensure_ascii=False)))
    return calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


def _parses(text: str) -> bool:
    return _json(text) is not _INVALID


_INVALID = object()
