"""A line's output constraint (structured outputs), from the fields vLLM's server and OpenAI take, on native lines
and OpenAI bodies alike: `response_format` (`json_object`, `json_schema`, vLLM's `structural_tag`),
`structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag"} with
`disable_any_whitespace`, `disable_additional_properties`, `whitespace_pattern`), or vLLM's older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar` / `guided_whitespace_pattern`. One constraint per line; its
checks are StructuredOutputsParams', their messages renamed to the line's field."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nvcli.jobs.jsonio import json_type as _json_type
from nvcli.sampling_params import CONSTRAINT_FIELDS, StructuredOutputsParams


class ConstraintError(ValueError):
    """A constraint field the line cannot be served with; the message names the field."""


# Structured outputs (native lines and OpenAI bodies alike, as vLLM's server takes them; their constraint fields are
# CONSTRAINT_FIELDS): vLLM's older guided_* names for them, and every field a line may constrain its output with.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *_GUIDED, "guided_decoding_backend",
                      "guided_whitespace_pattern")
# keys of vLLM's structured_outputs that nv ignores (the backend is always llguidance)
_SO_IGNORED = ("backend", "disable_fallback")
# structured_outputs' switches that modify the constraint (StructuredOutputsParams' fields of those names)
_SO_MODIFIERS = ("disable_any_whitespace", "disable_additional_properties")
_SO_WHITESPACE = "whitespace_pattern"  # a regular expression, also given as the line's guided_whitespace_pattern
_RESPONSE_FORMATS = '"text", "json_object", "json_schema", "structural_tag"'  # OpenAI's response_format types nv serves
# what a constraint's value must be, for values StructuredOutputsParams would take for "not set" (false, 0)
_CONSTRAINT_TYPES = {"json": "a JSON schema: an object or its JSON text", "regex": "a non-empty string",
                     "choice": "a non-empty list of non-empty strings", "grammar": "a non-empty Lark or GBNF grammar",
                     "json_object": "true or false",
                     "structural_tag": "a structural tag {\"triggers\", \"structures\"} or its JSON text"}


def line_constraint(
    obj: dict, default: StructuredOutputsParams | None, prefix: str, warn: Callable | None, exclusive: str = ""
) -> StructuredOutputsParams | None:
    """The constraint a line sets with response_format, structured_outputs or a guided_* field (at most one of them),
    else `default` (the job's `--json-schema`, or the schema of the line's tool_choice: `exclusive` names that, which
    then admits no constraint of the line's own), else None. vLLM's semantics; its checks are
    StructuredOutputsParams'."""
    found: list[tuple[str, str, Any]] = []  # (the line's field, StructuredOutputsParams' field, value)
    modifiers: dict[str, Any] = {}  # disable_any_whitespace, disable_additional_properties set true; whitespace_pattern
    whitespace_name = ""  # the line's field that gave whitespace_pattern
    fmt = obj.get("response_format")
    if fmt is not None:
        constraint = response_format(fmt, prefix + "response_format")
        if constraint is not None:
            found.append(constraint)
    so = obj.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ConstraintError(f"{prefix}structured_outputs must be a JSON object like {{\"json\": {{...}}}} or "
                           f"{{\"regex\": \"...\"}}, got {_json_type(so)}")
        for key, value in so.items():
            name = f"{prefix}structured_outputs.{key}"
            if key in CONSTRAINT_FIELDS:
                if value is not None and not (key == "json_object" and value is False):
                    found.append((name, key, value))
            elif key in _SO_MODIFIERS:
                if value is not None and not isinstance(value, bool):
                    raise ConstraintError(f"{name}: must be true or false (got {value!r})")
                if value:
                    modifiers[key] = True
            elif key == _SO_WHITESPACE:
                if value is not None:
                    modifiers[key] = whitespace_pattern(value, name)
                    whitespace_name = name
            elif key not in _SO_IGNORED and warn is not None:
                warn(f"ignoring unknown field {name!r}")
    for field_name, key in _GUIDED.items():
        if obj.get(field_name) is not None:
            found.append((prefix + field_name, key, obj[field_name]))
    if obj.get("guided_whitespace_pattern") is not None:
        pattern = whitespace_pattern(obj["guided_whitespace_pattern"], prefix + "guided_whitespace_pattern")
        if modifiers.get(_SO_WHITESPACE, pattern) != pattern:
            raise ConstraintError(f"{prefix}guided_whitespace_pattern and {prefix}structured_outputs.whitespace_pattern "
                           "differ: give one")
        modifiers[_SO_WHITESPACE] = pattern
        whitespace_name = prefix + "guided_whitespace_pattern"
    backend = obj.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):  # any backend name is served by llguidance
        raise ConstraintError(f"{prefix}guided_decoding_backend must be a string, got {_json_type(backend)}")
    if found and exclusive:
        raise ConstraintError(f"give one output constraint per line (got 2: {exclusive} constrains the output to tool calls, "
                       f"and {', '.join(name for name, _, _ in found)})")
    if len(found) > 1:
        raise ConstraintError(f"give one output constraint per line (got {len(found)}: "
                       + ", ".join(name for name, _, _ in found) + ")")
    if not found:
        if not modifiers:
            return default
        if default is None:
            first = next(iter(modifiers))
            name = whitespace_name if first == _SO_WHITESPACE else f"{prefix}structured_outputs.{first}"
            raise ConstraintError(f"{name} needs a constraint: set one of "
                           + ", ".join(CONSTRAINT_FIELDS))
        try:
            return dataclasses.replace(default, **modifiers)
        except ValueError as e:  # whitespace_pattern beside the job's compact --json-schema, say
            raise ConstraintError(str(e).replace(f"StructuredOutputsParams.{_SO_WHITESPACE}", whitespace_name, 1)) from None
    name, key, value = found[0]
    if not isinstance(value, bool) if key == "json_object" else isinstance(value, (bool, int, float)):
        raise ConstraintError(f"{name}: must be {_CONSTRAINT_TYPES[key]} (got {value!r})")
    try:
        return StructuredOutputsParams(**{key: value}, **modifiers)
    except ValueError as e:  # "StructuredOutputsParams.regex: must be ..." -> "body.guided_regex: must be ..."
        raise ConstraintError(str(e).replace(f"StructuredOutputsParams.{key}", name, 1)
                       .replace(f"StructuredOutputsParams.{_SO_WHITESPACE}", whitespace_name, 1)) from None


def whitespace_pattern(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConstraintError(f"{name}: must be a non-empty regular expression, the whitespace JSON may have between its "
                       f"tokens (got {value!r})")
    return value


def response_format(value: Any, name: str) -> tuple[str, str, Any] | None:
    """OpenAI's response_format: (name, StructuredOutputsParams' field, value), or None for plain text."""
    if not isinstance(value, dict):
        raise ConstraintError(f"{name} must be a JSON object like {{\"type\": \"json_object\"}}, got {_json_type(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return name, "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintError(f"{name}.json_schema must be a JSON object {{\"name\", \"schema\"}} when "
                           f"{name}.type is \"json_schema\", got {_json_type(spec)}")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ConstraintError(f"{name}.json_schema.schema must be a JSON schema (an object), got {_json_type(schema)}")
        return f"{name}.json_schema.schema", "json", schema
    if kind == "structural_tag":  # vLLM's: {"type", "structures", "triggers"}
        return name, "structural_tag", {key: item for key, item in value.items() if key != "type"}
    if isinstance(kind, str):
        raise ConstraintError(f"{name}.type {kind!r} is not supported: nv serves {_RESPONSE_FORMATS}")
    raise ConstraintError(f"{name}.type must be one of {_RESPONSE_FORMATS}, got {_json_type(kind)}")
