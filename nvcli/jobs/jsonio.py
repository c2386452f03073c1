"""JSON in and out: orjson when installed, the standard library otherwise.

Both paths produce compact UTF-8 bytes without a trailing newline; non-finite floats become
null so every line we write is strict JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any

try:  # pragma: no cover - which branch runs depends on the machine
    import orjson

    JSONDecodeError: type[Exception] = orjson.JSONDecodeError

    def loads(data: bytes | str) -> Any:
        return orjson.loads(data)

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover
    orjson = None  # type: ignore[assignment]
    JSONDecodeError = ValueError

    def loads(data: bytes | str) -> Any:
        return json.loads(data)

    def dumps(obj: Any) -> bytes:
        return json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# orjson.Fragment (orjson >= 3.9): bytes already serialized, written into a document as they are
FRAGMENTS = orjson is not None and hasattr(orjson, "Fragment")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_type(v: Any) -> str:
    """What kind of JSON value `v` is, for error messages: "null", "a boolean", "a number (3)", "a list", ..."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"a number ({v})"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__
