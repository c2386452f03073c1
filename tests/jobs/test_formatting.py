"""jobs/formatting.py writes logprobs from the engine's flat columns (outputs.FlatLogprobs) exactly as from the list of
{token_id: Logprob} dicts they stand for, in every output shape that carries them."""

from __future__ import annotations

import json
import re

import pytest

from nvcli.jobs.formatting import FormatContext, result_line
from nvcli.jobs.requests import Defaults, Request, parse_line
from nvcli.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput

PROMPT = [11, 12, 13, 14]
# positions 1..3 of the prompt: its own token first (with its rank), then the top alternatives without it
ENTRIES: list[dict[int, Logprob] | None] = [
    None,
    {12: Logprob(-0.25, 1, "b"), 40: Logprob(-1.5, 2, "x")},  # the token is the most likely
    {13: Logprob(-2.0, 3, "c"), 41: Logprob(-0.5, 1, "y"), 42: Logprob(-0.75, 2, "z")},
    {14: Logprob(-0.5, 2, "d"), 43: Logprob(-0.5, 1, "w")},  # a tie: the first listed stays first
]


def _flat(entries: list[dict[int, Logprob] | None]) -> FlatLogprobs:
    """ENTRIES as the engine hands them: columns, written out here (not converted by the code under test)."""
    assert entries is ENTRIES
    flat = FlatLogprobs([0, 0, 2, 5, 7], [12, 40, 13, 41, 42, 14, 43], [-0.25, -1.5, -2.0, -0.5, -0.75, -0.5, -0.5],
                        [1, 2, 3, 1, 2, 2, 1], ["b", "x", "c", "y", "z", "d", "w"])
    assert flat == ENTRIES
    return flat


LINES = {
    "native": {"prompt_token_ids": PROMPT, "prompt_logprobs": 2, "logprobs": 1, "max_tokens": 1},
    "echo": {"custom_id": "a", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 1}},
    "echo only": {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}},
    "chat": {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "q"}], "prompt_logprobs": 0, "logprobs": True,
                      "top_logprobs": 2, "max_tokens": 1}},
}


def _line(shape: str, prompt_logprobs: object) -> dict:
    req = parse_line(json.dumps(LINES[shape]), 0, Defaults())
    assert isinstance(req, Request)
    comp = CompletionOutput(0, "e", [50], "length", logprobs=[{50: Logprob(-0.125, 2, "e"), 51: Logprob(-0.1, 1, "f")}])
    out = RequestOutput("r", None, PROMPT, [comp], True, prompt_logprobs=prompt_logprobs)  # type: ignore[arg-type]
    text = json.dumps(result_line(req, out, FormatContext("m", created=0)))
    return json.loads(re.sub(r"-[0-9a-f]{32}", "", text))  # the random ids


@pytest.mark.parametrize("shape", list(LINES))
def test_flat_columns_give_the_line_the_dicts_give(shape: str) -> None:
    assert _line(shape, _flat(ENTRIES)) == _line(shape, ENTRIES)


def test_top_logprobs_are_the_most_likely_first_with_the_token_among_them() -> None:
    native = _line("native", _flat(ENTRIES))["prompt_logprobs"]
    assert native[0] is None
    assert [[t["token_id"] for t in p["top_logprobs"]] for p in native[1:]] == [[12, 40], [41, 42], [14, 43]]
    assert [(p["token"], p["logprob"]) for p in native[1:]] == [("b", -0.25), ("c", -2.0), ("d", -0.5)]
    echo = _line("echo", _flat(ENTRIES))["response"]["body"]["choices"][0]["logprobs"]
    assert echo["tokens"] == ["token_id:11", "b", "c", "d", "e"]
    assert echo["token_logprobs"] == [None, -0.25, -2.0, -0.5, -0.125]
    # vLLM's /v1/completions: the token itself, then the k most likely others (k + 1 where it is not among them)
    assert echo["top_logprobs"] == [None, {"b": -0.25, "x": -1.5}, {"c": -2.0, "y": -0.5, "z": -0.75},
                                    {"d": -0.5, "w": -0.5}, {"e": -0.125, "f": -0.1}]
    assert [list(top) for top in echo["top_logprobs"][1:]] == [["b", "x"], ["c", "y", "z"], ["d", "w"], ["e", "f"]]
    assert echo["text_offset"] == [0, 11, 12, 13, 14]
    only = _line("echo only", _flat(ENTRIES))["response"]["body"]["choices"][0]
    assert only["logprobs"]["top_logprobs"] == [None, {"b": -0.25, "x": -1.5}, {"c": -2.0, "y": -0.5},
                                                {"d": -0.5, "w": -0.5}]
    assert only["logprobs"]["token_logprobs"][0] is None  # the first prompt token: null in both lists, as vLLM
    assert only["finish_reason"] == "length"
    chat = _line("chat", _flat(ENTRIES))["response"]["body"]
    assert chat["prompt_logprobs"][2] == {"13": {"logprob": -2.0, "rank": 3, "decoded_token": "c"},
                                          "41": {"logprob": -0.5, "rank": 1, "decoded_token": "y"},
                                          "42": {"logprob": -0.75, "rank": 2, "decoded_token": "z"}}


# Logprobs a caller built by hand (LLM API users, other engines' outputs): a position's own token need not come first,
# and may be missing (then it has no logprob and no top entries), and alternatives come in any order.
ODD: list[dict[int, Logprob] | None] = [
    None,
    {40: Logprob(-1.5, 2, "x"), 12: Logprob(-0.25, 1, "b")},  # own token second
    {41: Logprob(-0.5, 1, "y"), 42: Logprob(-0.75, 2, "z")},  # own token (13) missing
    {43: Logprob(-0.5, 1, "w"), 44: Logprob(-0.125, 1, "v"), 14: Logprob(-0.5, 2, "d")},  # unsorted, a tie
]


def _expected(entry: dict[int, Logprob] | None, tid: int, k: int) -> tuple[float | None, list[int]]:
    """A position's logprob and its top k ids, read off its dict the plain way."""
    if not entry or tid not in entry:
        return None, []
    top = sorted(entry, key=lambda t: entry[t].logprob, reverse=True)[:k]  # stable: ties keep the dict's order
    return entry[tid].logprob, top


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_token_listed_late_or_not_at_all_is_still_found_or_left_without_logprob(k: int) -> None:
    LINES["odd"] = {"prompt_token_ids": PROMPT, "prompt_logprobs": k, "max_tokens": 1}
    try:
        native = _line("odd", FlatLogprobs.from_entries(ODD))["prompt_logprobs"]
    finally:
        del LINES["odd"]
    assert native[0] is None
    for tid, entry, got in zip(PROMPT[1:], ODD[1:], native[1:]):
        lp, top = _expected(entry, tid, k)
        assert got["token_id"] == tid and got["logprob"] == lp
        assert got["token"] == (entry[tid].decoded_token if entry and tid in entry else "token_id:13")
        if k:
            assert [t["token_id"] for t in got["top_logprobs"]] == top
        else:
            assert "top_logprobs" not in got
    echo = dict(LINES["echo"], body={**LINES["echo"]["body"], "logprobs": k, "max_tokens": 0})  # type: ignore[dict-item]
    LINES["odd"] = echo
    try:
        got_echo = _line("odd", FlatLogprobs.from_entries(ODD))["response"]["body"]["choices"][0]["logprobs"]
    finally:
        del LINES["odd"]
    assert got_echo["token_logprobs"] == [None, -0.25, None, -0.5]
    assert got_echo["tokens"] == ["token_id:11", "b", "token_id:13", "d"]
    assert got_echo["text_offset"] == [0, 11, 12, 23]
    texts = {t: v.decoded_token for e in ODD[1:] if e for t, v in e.items()}
    others = [sorted((t for t in e if t != tid), key=lambda t: e[t].logprob, reverse=True)[:k] if e else []
              for tid, e in zip(PROMPT[1:], ODD[1:])]
    assert got_echo["top_logprobs"] == [None] + [
        {texts[t]: e[t].logprob for t in (tid, *rest)} if e and tid in e else None  # type: ignore[index]
        for tid, e, rest in zip(PROMPT[1:], ODD[1:], others)]
