"""jobs/logprobs_json.py writes a line's logprob lists byte for byte as the dict formatter does, from the engine's
columns; columns that are not the engine's go to the dict formatter."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from nvcli.engine.sampler import TokenLogprobs
from nvcli.jobs import jsonio
from nvcli.jobs.formatting import FormatContext, result_line
from nvcli.jobs.logprobs_json import native_positions, vllm_positions
from nvcli.jobs.requests import Defaults, Request, parse_line
from nvcli.outputs import CompletionOutput, FlatLogprobs, RequestOutput

pytestmark = pytest.mark.skipif(not jsonio.FRAGMENTS, reason="needs orjson.Fragment")

# texts JSON must escape, several bytes of UTF-8, a replacement character, and plain ones
VOCAB = ['"', "\\", "\n", "\x00", "\t\x1f", "é", "😀", "\ufffd", " the", "</s>", *[f"t{i}" for i in range(40)]]


def engine_rows(rng: np.random.Generator, rows: int, k: int, ties: bool = True) -> TokenLogprobs:
    """The kernel's packed rows: per row a token, its logprob and rank, then its row's k most likely (distinct ids,
    most likely first). With `ties`, some rows' token ties with an alternative, some are among the top k."""
    packed = torch.zeros((rows, 3 + 2 * k), dtype=torch.int32)
    vals = -np.abs(rng.standard_normal((rows, k + 1)) * 3).astype(np.float32)
    vals[rng.random(rows) < 0.1, 0] = -np.inf
    vals[:, 1:] = -np.sort(-vals[:, 1:], axis=1)  # descending
    if k:
        vals[rng.random(rows) < 0.1, 1] = -0.0
        vals[rng.random(rows) < 0.1, k] = np.float32(-1.4e-7)
    ids = np.stack([rng.choice(len(VOCAB), size=k + 1, replace=False) for _ in range(rows)])
    if ties and k:
        tie = rng.random(rows) < 0.3
        vals[tie, 0] = vals[tie, 1 + rng.integers(0, k, tie.sum())]  # the same logprob as an alternative
        among = rng.random(rows) < 0.3
        pick = rng.integers(0, k, among.sum())
        ids[among, 0] = ids[among, 1 + pick]  # the token is one of the top k
        vals[among, 0] = vals[among, 1 + pick]
    packed[:, 0] = torch.from_numpy(ids[:, 0].astype(np.int32))
    packed[:, 1] = torch.from_numpy(vals[:, 0].copy()).view(torch.int32)
    packed[:, 2] = torch.from_numpy(rng.integers(1, 100, rows).astype(np.int32))
    packed[:, 3 : 3 + k] = torch.from_numpy(vals[:, 1:].copy()).view(torch.int32)
    packed[:, 3 + k :] = torch.from_numpy(ids[:, 1:].astype(np.int32))
    return TokenLogprobs(packed)


def engine_flat(rng: np.random.Generator, positions: int, k: int, empty_first: bool = True,
                **kwargs: bool) -> FlatLogprobs:
    """A sequence's logprobs as the engine builds them: views of two steps' columns, texts from its vocabulary."""
    seq = FlatLogprobs()
    if empty_first:
        seq.append_empty()
    half = positions // 2
    for n in (half, positions - half):
        step = engine_rows(rng, n, k, **kwargs).flat(np.full(n, k))
        seq.extend_from(step, 0, n)
    seq.use_vocabulary(VOCAB)
    return seq


def own_tokens(flat: FlatLogprobs) -> list[int]:
    """Each position's own token, read without making the columns lists (the engine's stay arrays)."""
    starts, ids = flat.arrays()[:2]
    return [int(ids[lo]) for lo, hi in zip(starts, starts[1:]) if lo < hi]


def both_ways(body: dict, out: RequestOutput) -> tuple[bytes, bytes]:
    """The line with logprob lists from the columns, then as dicts (which makes the columns lists)."""
    req = parse_line(json.dumps(body), 0, Defaults())
    assert isinstance(req, Request)
    got = [re.sub(rb"-[0-9a-f]{32}", b"", jsonio.dumps(result_line(req, out, FormatContext("m", created=0,
                                                                                          raw_json=raw))))
           for raw in (True, False)]
    return got[0], got[1]


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_native_prompt_logprobs_are_the_dicts_bytes(k: int) -> None:
    rng = np.random.default_rng(k)
    flat = engine_flat(rng, 300, k)
    prompt = [VOCAB.index(VOCAB[0])] + own_tokens(flat)
    assert native_positions(flat, prompt[1:], k, first=1) is not None  # the fast path runs
    out = RequestOutput("r", None, prompt, [CompletionOutput(0, "", [], "length")], True, prompt_logprobs=flat)
    raw, dicts = both_ways({"prompt_token_ids": prompt, "prompt_logprobs": k, "max_tokens": 1}, out)
    assert raw == dicts
    line = json.loads(raw)
    assert line["prompt_logprobs"][0] is None and len(line["prompt_logprobs"]) == len(prompt)
    if k:
        tops = [p["top_logprobs"] for p in line["prompt_logprobs"][1:]]
        assert all(len(t) == k for t in tops)
        assert all(a["logprob"] >= b["logprob"] for t in tops for a, b in zip(t, t[1:]) if a["logprob"] is not None)


@pytest.mark.parametrize("k", [0, 3])
def test_native_generated_logprobs_are_the_dicts_bytes(k: int) -> None:
    rng = np.random.default_rng(10 + k)
    flat = engine_flat(rng, 40, k, empty_first=False)
    tokens = own_tokens(flat)
    comp = CompletionOutput(0, "x", tokens, "length", logprobs=flat)
    out = RequestOutput("r", None, [1, 2], [comp], True)
    raw, dicts = both_ways({"prompt_token_ids": [1, 2], "logprobs": k, "max_tokens": 40}, out)
    assert raw == dicts and b'"logprobs":[{"token_id"' in raw


@pytest.mark.parametrize("shape", ["chat", "completion", "echo"])
def test_vllm_prompt_logprobs_are_the_dicts_bytes(shape: str) -> None:
    rng = np.random.default_rng(20)
    flat = engine_flat(rng, 200, 4)
    prompt = [0] + own_tokens(flat)
    assert vllm_positions(flat) is not None
    out = RequestOutput("r", None, prompt, [CompletionOutput(0, "e", [3], "length")], True, prompt_logprobs=flat)
    body: dict = {"chat": {"messages": [{"role": "user", "content": "q"}], "prompt_logprobs": 4, "max_tokens": 1},
                  "completion": {"prompt": prompt, "prompt_logprobs": 4, "max_tokens": 1},
                  "echo": {"prompt": prompt, "echo": True, "logprobs": 4, "max_tokens": 0}}[shape]
    url = "/v1/chat/completions" if shape == "chat" else "/v1/completions"
    raw, dicts = both_ways({"custom_id": "a", "method": "POST", "url": url, "body": body}, out)
    assert raw == dicts and b'"prompt_logprobs":[null,{"' in raw


def test_unsorted_alternatives_are_ordered_as_the_dicts_are() -> None:
    """Columns whose alternatives are not most likely first (no kernel writes them so) take the sorting path."""
    rng = np.random.default_rng(30)
    flat = engine_flat(rng, 100, 5)
    starts, ids, values, ranks = flat.arrays()
    shuffled = FlatLogprobs(starts, ids, values.copy(), ranks)
    for lo, hi in zip(starts[1:-1], starts[2:]):
        rng.shuffle(shuffled._logprobs[lo + 1 : hi])
    shuffled.use_vocabulary(VOCAB)
    prompt = [0] + own_tokens(shuffled)
    assert native_positions(shuffled, prompt[1:], 3, first=1) is not None
    out = RequestOutput("r", None, prompt, [CompletionOutput(0, "", [], "length")], True, prompt_logprobs=shuffled)
    raw, dicts = both_ways({"prompt_token_ids": prompt, "prompt_logprobs": 3, "max_tokens": 1}, out)
    assert raw == dicts


def test_columns_that_are_not_the_engines_are_formatted_as_dicts() -> None:
    rng = np.random.default_rng(40)
    flat = engine_flat(rng, 50, 3)
    prompt = [0] + own_tokens(flat)
    starts, ids, values, ranks = flat.arrays()
    with_nan = FlatLogprobs(starts, ids, np.where(np.arange(len(values)) == 7, np.nan, values), ranks)
    with_nan.use_vocabulary(VOCAB)
    assert native_positions(with_nan, prompt[1:], 3, first=1) is None and vllm_positions(with_nan) is None
    texts = FlatLogprobs(starts, ids, values, ranks, [VOCAB[i] for i in ids])  # texts given per entry
    assert native_positions(texts, prompt[1:], 3, first=1) is None and vllm_positions(texts) is None
    assert native_positions(flat, [prompt[2], *prompt[2:]], 3, first=1) is None  # not each position's own token
    short = FlatLogprobs(starts, ids, values, ranks)
    short.use_vocabulary(VOCAB[:5])  # a table that lacks some of the ids
    assert native_positions(short, prompt[1:], 3, first=1) is None and vllm_positions(short) is None
    assert native_positions(flat, [*prompt[1:], prompt[1]], 3, first=1) is None  # more tokens than positions
    unknown = FlatLogprobs(starts, ids, [None, *values.tolist()[1:]], ranks)  # a logprob a caller left out
    unknown.use_vocabulary(VOCAB)
    assert native_positions(unknown, prompt[1:], 3, first=1) is None and vllm_positions(unknown) is None
    twice = FlatLogprobs(starts, np.where(np.arange(len(ids)) == starts[5] + 1, ids[starts[5]], ids), values, ranks)
    twice.use_vocabulary(VOCAB)
    assert vllm_positions(twice) is None  # a dict would keep one of the two
    for odd in (with_nan, texts, twice):
        out = RequestOutput("r", None, prompt, [CompletionOutput(0, "", [], "length")], True, prompt_logprobs=odd)
        for body in ({"prompt_token_ids": prompt, "prompt_logprobs": 3, "max_tokens": 1},
                     {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": prompt, "prompt_logprobs": 3, "max_tokens": 1}}):
            raw, dicts = both_ways(body, out)
            assert raw == dicts


def test_a_pickled_copy_reads_the_workers_vocabulary() -> None:
    """A formatting process gets the columns without their texts and the job's vocabulary in its context."""
    import pickle

    rng = np.random.default_rng(50)
    flat = engine_flat(rng, 60, 2)
    prompt = [0] + own_tokens(flat)
    copy = pickle.loads(pickle.dumps(flat))
    assert copy.vocabulary is None and copy.wants_vocabulary
    req = parse_line(json.dumps({"prompt_token_ids": prompt, "prompt_logprobs": 2, "max_tokens": 1}), 0, Defaults())
    out = RequestOutput("r", None, prompt, [CompletionOutput(0, "", [], "length")], True, prompt_logprobs=copy)
    worker = jsonio.dumps(result_line(req, out, FormatContext("m", created=0, vocabulary=VOCAB, raw_json=True)))
    assert copy.vocabulary is VOCAB  # the fast path ran on the worker's table
    out.prompt_logprobs = flat
    assert worker == jsonio.dumps(result_line(req, out, FormatContext("m", created=0)))
