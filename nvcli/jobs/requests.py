"""Turn one JSONL input line into a request (or a per-line error), for every input shape.

Shapes:
- native: `{"prompt": str}`, `{"messages": [...]}` or `{"prompt_token_ids": [int, ...]}`, with
  optional `id` and sampling fields at the top level;
- OpenAI Batch envelope: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
  "/v1/completions", "body": {...}}`, answered in the OpenAI Batch output shape.

A line may constrain its output (structured outputs, constraints.py); one constraint per line. A line without one
takes the job's (`--json-schema`), if any.

A chat line (`messages`, native or /v1/chat/completions) may offer functions: `tools`, `tool_choice`,
`parallel_tool_calls` (tool_calls.py validates them); tool_choice "required" or a named function is the line's
constraint, and then it may set no other. Assistant tool-call turns and tool results are taken as chat templates
want them (tool_calls.template_message).

A line's id is its `id`, else its `custom_id`, else its line number (1-based, as editors count and as an error
line's "line" says). A line whose id cannot be read (not
JSON, not an object, an id of another type) is answered with `"id": null` and its line number: it must not take an id
that another line may own. Per-line sampling fields override the command-line defaults. Nothing here touches the engine: chat rendering and
tokenization happen in the reader, so this module is testable without a model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nvcli.jobs import jsonio
from nvcli.jobs.constraints import STRUCTURED_FIELDS, ConstraintError, line_constraint
from nvcli.jobs.jsonio import json_type as _json_type
from nvcli.jobs.tool_calls import ToolCallError, ToolSpec, parse_tools, template_message
from nvcli.sampling_params import SamplingParams, StructuredOutputsParams
from nvcli.token_ids import valid_token_ids

NATIVE = "native"
CHAT = "chat"  # OpenAI /v1/chat/completions envelope
COMPLETION = "completion"  # OpenAI /v1/completions envelope
OPENAI_SHAPES = (CHAT, COMPLETION)
URLS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}

# Error kinds (the "type" of an error line).
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
PROMPT_TOO_LONG = "prompt_too_long"
DUPLICATE_ID = "duplicate_id"
ENGINE_ERROR = "engine_error"

# SamplingParams fields a line may set directly (vLLM names).
SAMPLING_FIELDS = (
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "truncate_prompt_tokens",
)
# a logit_bias key: ASCII digits (str.isdigit takes "²"), few enough for int() (it refuses over 4300)
_TOKEN_ID = re.compile(r"[0-9]{1,32}")
_INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_NATIVE_OWN = ("id", "custom_id", "prompt", "messages", "prompt_token_ids", "chat_template_kwargs", "return_token_ids",
               "tools", "tool_choice", "parallel_tool_calls", "priority")
# Body fields of OpenAI requests that we accept and ignore (no effect on generation).
_OPENAI_IGNORED = ("model", "user", "metadata", "store", "stream", "stream_options", "service_tier")
# OpenAI sampling knobs we do not implement: accepted only at their neutral values (None, the first, is "left out";
# clients often send the others explicitly).
_OPENAI_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": (None, ""),
}
# Tool calling (tool_calls.py) is a chat feature: a /v1/completions body may carry its fields at "no tools" only.
_COMPLETION_TOOLS: dict[str, tuple[Any, ...]] = {"tools": (None, []), "tool_choice": (None, "none")}


@dataclass
class Defaults:
    """Job-wide defaults: command-line sampling flags, chat template kwargs, output extras, and the output constraint
    (`--json-schema`) of every line that sets none of its own."""

    sampling: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_ids: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    tool_call_parser: str = "auto"  # --tool-call-parser: how tool_choice "auto" reads calls from the text


@dataclass
class Request:
    """A line that passed validation: what to generate and how to answer it."""

    line_no: int
    id: str | int
    key: str
    shape: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    custom_id: str | None = None
    return_token_ids: bool = False
    ordinal: int = -1  # position among output lines, assigned by the reader
    echo: bool = False  # /v1/completions: the prompt leads the text (and, with logprobs, the logprobs)
    echo_prompt_only: bool = False  # echo with max_tokens 0: one token is generated and not returned (vLLM's)
    tools: ToolSpec | None = None  # the functions a chat line offers, and its tool_choice
    priority: int = 0  # vLLM's, with --scheduling-policy priority: lower is served first (the engine checks the policy)


@dataclass
class LineError:
    """A line that cannot be served; it is answered with one error line."""

    line_no: int
    id: str | int | None  # None: the line's id could not be read (keyed by its line number)
    key: str
    shape: str
    kind: str
    message: str
    custom_id: str | None = None
    ordinal: int = -1


class _Invalid(Exception):
    def __init__(self, message: str, kind: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.kind = kind


def id_key(value: str | int) -> str:
    """Canonical key of an id: "5" and 5 are different ids; the key never looks at prompts."""
    return f"s:{value}" if isinstance(value, str) else f"i:{value}"


def line_key(line_no: int) -> str:
    """Key of an output line that answers an input line by its position, not by an id: a line whose id could not be
    read, and a duplicate id's error line (the id belongs to the earlier line). `line_no` is 0-based."""
    return f"l:{line_no}"


def read_line_id(raw: bytes, line_no: int) -> str | int | None:
    """The id parse_line gives the non-blank input line `raw` at 0-based `line_no` (its "id", else its "custom_id",
    else its line number, 1-based) without the rest of its work; None where parse_line answers with "id": null (not
    JSON, not an object, an id neither a string nor an integer). It must agree with parse_line (a test checks): nv
    merge reads an input's ids with it."""
    if line_no == 0 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        obj = jsonio.loads(raw)
    except (jsonio.JSONDecodeError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    rid = obj.get("id", obj.get("custom_id"))
    if rid is None:
        return line_no + 1
    return rid if _valid_id(rid) else None


def parse_line(
    raw: bytes | str,
    line_no: int,
    defaults: Defaults,
    warn: Callable[[str], None] | None = None,
    fallback_shape: str = NATIVE,
) -> Request | LineError:
    """Parse one non-blank input line. `line_no` is 0-based; `fallback_shape` is used for lines
    too broken to tell their shape (a file of OpenAI requests keeps OpenAI-shaped errors)."""
    if line_no == 0 and isinstance(raw, bytes) and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte order mark, as some editors write
    try:
        obj = jsonio.loads(raw)
    except (jsonio.JSONDecodeError, ValueError) as e:
        where = f" at column {e.colno}" if getattr(e, "colno", None) else ""
        why = getattr(e, "msg", None) or str(e)
        return _error(line_no, None, fallback_shape, INVALID_JSON, f"line {line_no + 1} is not valid JSON: {why}{where}")
    if not isinstance(obj, dict):
        return _error(
            line_no, None, fallback_shape, INVALID_REQUEST,
            f"line {line_no + 1} must be a JSON object, got {_json_type(obj)}",
        )
    shape = NATIVE
    custom_id = obj.get("custom_id")
    rid: Any = obj.get("id", custom_id)
    if rid is None:
        rid = line_no + 1
    if not _valid_id(rid):
        name = "id" if "id" in obj else "custom_id"
        return _error(
            line_no, None, fallback_shape, INVALID_REQUEST,
            f"{name} must be a string or an integer, got {_json_type(rid)}",
        )
    if custom_id is not None and not isinstance(custom_id, str):
        custom_id = str(custom_id) if _valid_id(custom_id) else None
    try:
        if "url" in obj or "body" in obj:
            url = obj.get("url")
            shape = URLS.get(url, CHAT) if isinstance(url, str) else CHAT  # errors: OpenAI-shaped either way
            shape, req = _parse_openai(obj, line_no, rid, defaults, warn)
        else:
            req = _parse_native(obj, line_no, rid, defaults, warn)
    except _Invalid as e:
        return _error(line_no, rid, shape, e.kind, str(e), custom_id)
    req.custom_id = custom_id
    return req


def _error(line_no: int, rid: str | int | None, shape: str, kind: str, message: str,
           custom_id: str | None = None) -> LineError:
    return LineError(line_no, rid, line_key(line_no) if rid is None else id_key(rid), shape, kind, message, custom_id)


def _parse_native(obj: dict, line_no: int, rid: str | int, defaults: Defaults, warn: Callable | None) -> Request:
    _warn_unknown(obj, set(_NATIVE_OWN) | set(SAMPLING_FIELDS) | set(STRUCTURED_FIELDS), "", warn)
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if k in obj]
    if not given:
        raise _Invalid("missing prompt: give one of \"prompt\", \"messages\" or \"prompt_token_ids\"")
    if len(given) > 1:
        raise _Invalid(f"give only one of \"prompt\", \"messages\" or \"prompt_token_ids\" (got {', '.join(given)})")
    overrides = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    if overrides.get("logprobs") is True:
        overrides["logprobs"] = 0
    elif overrides.get("logprobs") is False:
        overrides["logprobs"] = None
    tools = _tools(obj, "")
    if tools is not None and given[0] != "messages":
        raise _Invalid(f"tools need \"messages\": a {given[0]} line cannot call tools (send the conversation as "
                       "messages, rendered with the model's chat template)")
    _constrain(overrides, obj, defaults, "", warn, tools)
    req = Request(line_no, rid, id_key(rid), NATIVE, _sampling(defaults, overrides))
    req.tools = tools
    req.return_token_ids = _bool(obj, "return_token_ids", defaults.return_token_ids)
    req.priority = _priority(obj, "")
    _fill_prompt(req, obj, given[0], defaults)
    return req


def _parse_openai(
    obj: dict, line_no: int, rid: str | int, defaults: Defaults, warn: Callable | None
) -> tuple[str, Request]:
    url = obj.get("url")
    shape = URLS.get(url) if isinstance(url, str) else None
    if shape is None:
        raise _Invalid(f"unknown url {url!r}: nv serves {' and '.join(URLS)}")
    _warn_unknown(obj, {"id", "custom_id"}, "", warn)  # the envelope's own fields
    method = obj.get("method", "POST")
    if method != "POST":
        raise _Invalid(f"method must be \"POST\", got {method!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Invalid(f"body must be a JSON object, got {_json_type(body)}")
    return shape, _parse_openai_body(body, shape, line_no, rid, defaults, warn)


def _parse_openai_body(
    body: dict, shape: str, line_no: int, rid: str | int, defaults: Defaults, warn: Callable | None
) -> Request:
    common = tuple(f for f in SAMPLING_FIELDS if f != "logprobs")  # OpenAI's logprobs differ by endpoint (below)
    known = set(common) | set(_OPENAI_IGNORED) | set(_OPENAI_NEUTRAL) | set(STRUCTURED_FIELDS)
    known |= {"return_token_ids", "logprobs", "echo", "tools", "tool_choice", "parallel_tool_calls", "priority"}
    if shape == CHAT:
        known |= {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"}
    else:
        known |= {"prompt"}
    _warn_unknown(body, known, "body.", warn)
    for name, neutral in _OPENAI_NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same_json(value, v) for v in neutral):
            raise _Invalid(f"body.{name}={value!r} is not supported by nv (leave it out)")
    tools = None
    if shape == CHAT:
        tools = _tools(body, "body.")
    else:
        for name, neutral in _COMPLETION_TOOLS.items():
            value = body.get(name)
            if not any(_same_json(value, v) for v in neutral):
                raise _Invalid(f"body.{name}={value!r}: tool calling is served on /v1/chat/completions only")
    overrides = {k: body[k] for k in common if k in body and body[k] is not None}
    _constrain(overrides, body, defaults, "body.", warn, tools)
    echo = _bool(body, "echo", False, prefix="body.")
    if shape == CHAT:
        if echo:
            raise _Invalid("body.echo is supported for /v1/completions only")
        if body.get("max_completion_tokens") is not None:
            overrides["max_tokens"] = body["max_completion_tokens"]
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp not in (None, True, False):
            raise _Invalid(f"body.logprobs must be true or false for chat completions, got {lp!r}")
        if top is not None and not lp:
            raise _Invalid("body.top_logprobs needs body.logprobs=true")
        if lp:
            overrides["logprobs"] = 0 if top is None else top
        req = Request(line_no, rid, id_key(rid), CHAT, _sampling(defaults, overrides, prefix="body."))
        req.tools = tools
        _fill_prompt(req, body, "messages", defaults, prefix="body.")
    else:
        if body.get("logprobs") is not None:
            overrides["logprobs"] = body["logprobs"]
            if echo:  # the echoed prompt's tokens get logprobs too (vLLM: prompt_logprobs = logprobs)
                overrides["prompt_logprobs"] = body["logprobs"]
        zero = overrides.get("max_tokens")
        # scoring a prompt: lm-eval-harness asks this way
        prompt_only = echo and type(zero) in (int, float) and zero == 0
        if prompt_only:
            overrides["max_tokens"] = 1
        req = Request(line_no, rid, id_key(rid), COMPLETION, _sampling(defaults, overrides, prefix="body."))
        req.echo, req.echo_prompt_only = echo, prompt_only
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if prompt is None:
            raise _Invalid("missing prompt: body.prompt is required for /v1/completions")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise _Invalid("body.prompt holds several prompts: put one prompt per line")
        key = "prompt_token_ids" if isinstance(prompt, list) else "prompt"
        _fill_prompt(req, {key: prompt}, key, defaults, prefix="body.")
    req.return_token_ids = _bool(body, "return_token_ids", defaults.return_token_ids, prefix="body.")
    req.priority = _priority(body, "body.")  # vLLM's OpenAI server takes it in the request body
    return req


def _tools(obj: dict, prefix: str) -> ToolSpec | None:
    try:
        return parse_tools(obj, prefix)
    except ToolCallError as e:
        raise _Invalid(str(e)) from None


def _constrain(overrides: dict[str, Any], obj: dict, defaults: Defaults, prefix: str, warn: Callable | None,
               tools: ToolSpec | None = None) -> None:
    """Put the line's output constraint into the sampling overrides: that of its tool_choice ("required" or a named
    function), else the one it sets itself, else the job's."""
    schema = tools.schema() if tools is not None else None
    if tools is None or schema is None:
        default, exclusive = defaults.structured_outputs, ""
    else:
        choice = tools.choice if tools.name is None else f"naming {tools.name!r}"
        default, exclusive = StructuredOutputsParams(json=schema), f"{prefix}tool_choice {choice}"
    try:
        params = line_constraint(obj, default, prefix, warn, exclusive)
    except ConstraintError as e:
        raise _Invalid(str(e)) from None
    if params is not None:
        overrides["structured_outputs"] = params


def _fill_prompt(req: Request, obj: dict, key: str, defaults: Defaults, prefix: str = "") -> None:
    value = obj[key]
    if key == "prompt":
        if not isinstance(value, str):
            raise _Invalid(f"{prefix}prompt must be a string, got {_json_type(value)}")
        if value == "":
            raise _Invalid(f"{prefix}prompt is empty")
        req.prompt = value
    elif key == "prompt_token_ids":
        name = prefix + ("prompt" if prefix else "prompt_token_ids")
        if not isinstance(value, list) or not valid_token_ids(value):
            raise _Invalid(f"{name} must be a list of non-negative integer token ids")
        if not value:
            raise _Invalid(f"{name} is empty")
        req.prompt_token_ids = value
    else:
        req.messages = _messages(value, prefix)
        kwargs = obj.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise _Invalid(f"{prefix}chat_template_kwargs must be a JSON object, got {_json_type(kwargs)}")
        req.chat_template_kwargs = {**defaults.chat_template_kwargs, **(kwargs or {})}


def _messages(value: Any, prefix: str) -> list[dict[str, Any]]:
    name = prefix + "messages"
    if not isinstance(value, list):
        raise _Invalid(f"{name} must be a list of {{\"role\", \"content\"}} objects, got {_json_type(value)}")
    if not value:
        raise _Invalid(f"{name} is empty")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _Invalid(f"{name}[{i}] must be an object with \"role\" and \"content\", got {_json_type(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _Invalid(f"{name}[{i}].role must be a non-empty string")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _Invalid(f"{name}[{i}].content[{j}]: only {{\"type\": \"text\", \"text\": ...}} parts are supported")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise _Invalid(f"{name}[{i}].content must be a string or a list of text parts, got {_json_type(content)}")
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise _Invalid(f"{name}[{i}].tool_call_id must be a string, got {_json_type(m['tool_call_id'])}")
        try:
            out.append(template_message(m, f"{name}[{i}]"))
        except ToolCallError as e:
            raise _Invalid(str(e)) from None
    return out


def _sampling(defaults: Defaults, overrides: dict[str, Any], prefix: str = "") -> SamplingParams:
    merged = {**defaults.sampling, **overrides}
    if isinstance(merged.get("logit_bias"), dict):
        merged["logit_bias"] = _logit_bias(merged["logit_bias"], prefix)
    for k in _INT_FIELDS:  # 10.0 -> 10, as a lenient JSON client would
        v = merged.get(k)
        if isinstance(v, float) and math.isfinite(v) and v == int(v):
            merged[k] = int(v)
    try:
        return SamplingParams(**merged)
    except ValueError as e:
        raise _Invalid(prefix + str(e).removeprefix("SamplingParams.")) from None


def _logit_bias(value: dict, prefix: str) -> dict:
    """JSON object keys are strings: {"50256": -100} -> {50256: -100}. The values are SamplingParams' to check."""
    out = {}
    for key, bias in value.items():
        if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            key = int(key)
        elif not _is_int(key):
            raise _Invalid(f"{prefix}logit_bias: keys must be token ids, strings of digits like \"50256\" (got {key!r})")
        out[key] = bias
    return out


def _bool(obj: dict, key: str, default: bool, prefix: str = "") -> bool:
    v = obj.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _Invalid(f"{prefix}{key} must be true or false, got {_json_type(v)}")
    return v


def _priority(obj: dict, prefix: str) -> int:
    """The line's `priority`: an integer (2.0 reads as 2, as the sampling integers do); null or left out is 0."""
    v = obj.get("priority")
    if v is None:
        return 0
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    if not _is_int(v):
        raise _Invalid(f"{prefix}priority must be an integer (lower is served first), got {_json_type(v)}")
    return v


def _warn_unknown(obj: dict, known: set[str], prefix: str, warn: Callable[[str], None] | None) -> None:
    if warn is None:
        return
    for k in obj:
        if k not in known and k not in ("url", "method", "body"):
            warn(f"ignoring unknown field {prefix + k!r}")


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality where true is not 1 (Python's == says it is)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _valid_id(v: Any) -> bool:
    return isinstance(v, str) or _is_int(v)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
