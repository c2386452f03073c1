"""The JSON layer works with orjson and without it (the GPU machine has no orjson)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from nvcli.jobs import jsonio
from nvcli.jobs.requests import INVALID_JSON, Defaults, LineError, Request, parse_line


@pytest.fixture(params=["orjson", "stdlib"])
def backend(request, monkeypatch):
    if request.param == "stdlib":
        monkeypatch.setitem(sys.modules, "orjson", None)  # import orjson -> ImportError
    importlib.reload(jsonio)
    yield request.param
    monkeypatch.undo()
    importlib.reload(jsonio)


def test_round_trip_and_errors(backend):
    obj = {"id": "é", "text": "日本", "n": [1, 2.5, None], "lp": float("-inf")}
    data = jsonio.dumps(obj)
    assert isinstance(data, bytes) and b"\n" not in data and b" " not in data
    assert json.loads(data) == {**obj, "lp": None}  # strict JSON: no -Infinity
    assert isinstance(parse_line(b'{"prompt": "x"}', 0, Defaults()), Request)
    bad = parse_line(b'{"prompt": "x', 3, Defaults())
    assert isinstance(bad, LineError) and bad.kind == INVALID_JSON and "line 4" in bad.message
    bad = parse_line(b'{"prompt": "\xff"}', 3, Defaults())
    assert isinstance(bad, LineError) and bad.kind == INVALID_JSON
