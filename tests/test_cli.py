"""`nv generate` end to end with the real engine on a tiny random Qwen3 (real tokenizer), on CPU.

Most checks run in-process through Typer's CliRunner; a few run `python -m nvcli` / `nv` as a
user would, in a shell pipeline, and kill it (SIGKILL, SIGINT) mid-job.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from nvcli.cli import app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FAST = ["--device", "cpu", "--num-kvcache-blocks", "256", "--max-model-len", "512", "--temperature", "0"]
runner = CliRunner()


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("qwen3"))


def nv(model: str, *args, input: str | None = None):
    r = runner.invoke(app, ["generate", *map(str, args), "--model", model, *FAST], input=input)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def jsonl(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines()]


def write(path: Path, objs) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def nv_argv() -> list[str]:
    """The installed console script when there is one (CI installs the package), else python -m nvcli."""
    script = Path(sys.executable).with_name("nv")
    return [str(script)] if script.exists() else [sys.executable, "-m", "nvcli"]


# -- in-process --------------------------------------------------------------------------------
def test_every_input_shape_file_to_file(model, tmp_path):
    src = tmp_path / "all.jsonl"
    with open(src, "w") as f:  # the examples, with their token budgets cut to keep CPU time short
        for name in ("prompts.jsonl", "chat.jsonl", "tokens.jsonl", "openai_batch.jsonl"):
            for line in (EXAMPLES / name).read_text().splitlines():
                obj = json.loads(line)
                for d in (obj, obj.get("body", {})):
                    for k in ("max_tokens", "max_completion_tokens"):
                        if k in d:
                            d[k] = min(d[k], 8)
                f.write(json.dumps(obj) + "\n")
    out = tmp_path / "out.jsonl"
    r = nv(model, src, "-o", out, "--max-tokens", 6, "--ignore-eos", "--no-thinking")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""
    lines = jsonl(out.read_text())
    n_in = [len((EXAMPLES / f).read_text().splitlines()) for f in
            ("prompts.jsonl", "chat.jsonl", "tokens.jsonl", "openai_batch.jsonl")]
    assert len(lines) == sum(n_in)
    by_id = {x["id"]: x for x in lines}
    # native prompt; the line without an id got its line number, 1-based as an error line's "line"
    assert by_id["france"]["finish_reason"] == "length" and by_id["france"]["usage"]["completion_tokens"] == 6
    assert 5 in by_id and isinstance(by_id[5]["text"], str)
    assert by_id["haiku"]["usage"]["completion_tokens"] == 8  # the line's max_tokens beats --max-tokens
    # chat: a per-line chat_template_kwargs beats --no-thinking (Qwen3's template adds an empty think block)
    assert by_id["think"]["usage"]["prompt_tokens"] < by_id["greet"]["usage"]["prompt_tokens"] + 10
    # pre-tokenized, with token ids and logprobs on request
    fox = by_id["fox"]
    assert fox["usage"]["prompt_tokens"] == 4 and len(fox["token_ids"]) == 8
    story = by_id["story"]
    assert len(story["logprobs"]) == 8 and len(story["logprobs"][0]["top_logprobs"]) == 2
    assert "token_ids" not in story
    # OpenAI Batch envelopes: chat and completions
    req1 = by_id["request-1"]
    assert req1["custom_id"] == "request-1" and req1["error"] is None and req1["response"]["status_code"] == 200
    body = req1["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["total_tokens"] == (
        body["usage"]["prompt_tokens"] + 8)
    assert len(by_id["request-2"]["response"]["body"]["choices"][0]["logprobs"]["content"]) == 8
    body3 = by_id["request-3"]["response"]["body"]
    assert body3["object"] == "text_completion" and body3["choices"][0]["finish_reason"] in ("stop", "length")


def test_per_line_overrides_and_chat_flags(model):
    data = "".join(json.dumps(x) + "\n" for x in [
        {"id": "a", "prompt": "Hello", "max_tokens": 3},
        {"id": "b", "prompt": "Hello", "max_tokens": 7},
        {"id": "c", "prompt": "Hello"},
        {"id": "d", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"id": "e", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
         "chat_template_kwargs": {"enable_thinking": True}},
        {"id": "f", "prompt": "Hello", "max_tokens": 7, "stop": ["e"], "temperature": 0.8, "seed": 1},
    ])
    r = nv(model, "-", "--max-tokens", 5, "--ignore-eos", "--no-thinking", "-q", input=data)
    assert r.exit_code == 0, r.stderr
    by_id = {x["id"]: x for x in jsonl(r.stdout)}
    assert [by_id[k]["usage"]["completion_tokens"] for k in "abc"] == [3, 7, 5]
    assert by_id["a"]["text"] == by_id["b"]["text"][: len(by_id["a"]["text"])]  # greedy: a prefix
    assert by_id["d"]["usage"]["prompt_tokens"] > by_id["e"]["usage"]["prompt_tokens"]  # --no-thinking adds tokens
    assert "e" not in by_id["f"]["text"]
    assert r.stderr == ""


def test_n_completions_per_line(model):
    """n > 1: a native line lists its completions under "outputs", an OpenAI line under "choices"; usage counts
    every completion's tokens and the prompt once; still one output line per input line."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 4, "temperature": 1.0,
            "seed": 5, "logprobs": True}
    data = "".join(json.dumps(x) + "\n" for x in [
        {"id": "a", "prompt": "Hello there", "n": 2, "max_tokens": 5, "return_token_ids": True, "logprobs": 1},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"id": "c", "prompt": "Hello there", "max_tokens": 5},
    ])
    r = nv(model, "-", "--ignore-eos", "-q", input=data)
    assert r.exit_code == 0, r.stderr
    a, b, c = jsonl(r.stdout)
    assert "text" not in a and [o["index"] for o in a["outputs"]] == [0, 1]
    for o in a["outputs"]:
        assert len(o["token_ids"]) == 5 and len(o["logprobs"]) == 5 and o["finish_reason"] == "length"
    assert a["outputs"][0]["text"] == a["outputs"][1]["text"] == c["text"]  # greedy (--temperature 0)
    assert a["usage"] == {"prompt_tokens": c["usage"]["prompt_tokens"], "completion_tokens": 10}
    body = b["response"]["body"]
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert all(len(ch["logprobs"]["content"]) == 4 for ch in body["choices"])
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 12


def test_penalties_are_served(model):
    data = "".join(json.dumps(x) + "\n" for x in [
        {"id": "a", "prompt": "Hello", "max_tokens": 6, "frequency_penalty": 0.5, "presence_penalty": 0.5},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hello", "max_tokens": 6, "repetition_penalty": 1.2}},
    ])
    r = nv(model, "-", "--ignore-eos", "-q", input=data)
    assert r.exit_code == 0, r.stderr
    a, b = jsonl(r.stdout)
    assert a["usage"]["completion_tokens"] == 6 and "error" not in a
    assert b["response"]["status_code"] == 200


def test_prompt_logprobs_score_every_prompt_token(model):
    """A scoring job: native lines get one entry per prompt token (null first), OpenAI lines vLLM's shape in each
    completion choice and at the top of a chat body, all from the same model logits; --prompt-logprobs sets it for
    every line, and an out-of-range value is an error line that loses nothing else."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 1}
    data = "".join(json.dumps(x) + "\n" for x in [
        {"id": "a", "prompt": "The cat sat on the mat", "max_tokens": 1, "prompt_logprobs": 2, "n": 2},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The cat sat on the mat", "max_tokens": 1, "prompt_logprobs": 0}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"id": "d", "prompt": "The cat", "prompt_logprobs": 21},
        {"id": "e", "prompt": "The cat sat on the mat", "max_tokens": 1},
    ])
    r = nv(model, "-", "-q", input=data)
    assert r.exit_code == 1 and "1 line failed" in r.stderr  # line d
    a, b, c, d, e = jsonl(r.stdout)
    n_prompt = a["usage"]["prompt_tokens"]
    scores = a["prompt_logprobs"]
    assert len(scores) == n_prompt and scores[0] is None
    for entry in scores[1:]:
        assert set(entry) == {"token_id", "token", "logprob", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"] + 1e-6
    vllm_shape = b["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert len(vllm_shape) == n_prompt and vllm_shape[0] is None
    for native, entry in zip(scores[1:], vllm_shape[1:]):
        assert list(entry) == [str(native["token_id"])]  # k = 0: the prompt's own token only
        assert entry[str(native["token_id"])]["logprob"] == pytest.approx(native["logprob"], abs=1e-5)
    chat_scores = c["response"]["body"]["prompt_logprobs"]
    assert chat_scores[0] is None and len(chat_scores) == c["response"]["body"]["usage"]["prompt_tokens"]
    assert "prompt_logprobs" in d["error"]["message"]
    assert "prompt_logprobs" not in e
    r = nv(model, "-", "-q", "--prompt-logprobs", 0, "--max-tokens", 1, input=json.dumps({"prompt": "The cat"}) + "\n")
    (line,) = jsonl(r.stdout)
    assert len(line["prompt_logprobs"]) == line["usage"]["prompt_tokens"]


def test_completions_echo_scores_the_prompt(model):
    """/v1/completions with echo (how lm-eval-harness scores a continuation): the prompt leads the text and the
    logprobs, its first token without one; max_tokens 0 returns the prompt alone and counts no completion tokens.
    echo on a chat line and max_tokens 0 without echo are error lines."""
    def completion(custom_id: str, **body) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}

    prompt = "The cat sat on the mat"
    data = "".join(json.dumps(x) + "\n" for x in [
        completion("score", prompt=prompt, max_tokens=0, echo=True, logprobs=1),
        completion("continue", prompt=prompt, max_tokens=3, echo=True, logprobs=0),
        completion("plain", prompt=prompt, max_tokens=3, logprobs=0),
        {"id": "native", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "echo": True}},
        completion("zero", prompt=prompt, max_tokens=0),
    ])
    r = nv(model, "-", "-q", "--ignore-eos", input=data)
    assert r.exit_code == 1 and "2 lines failed" in r.stderr
    score, cont, plain, native, chat, zero = jsonl(r.stdout)
    body = score["response"]["body"]
    choice = body["choices"][0]
    n_prompt = body["usage"]["prompt_tokens"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e["logprob"] for e in native["prompt_logprobs"][1:]], abs=1e-5)
    # vLLM's shape: each token's own entry, plus the most likely other where the token is not the most likely
    assert all(tok in top and len(top) == (1 if max(top.values()) == top[tok] else 2)
               for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    plain_choice = plain["response"]["body"]["choices"][0]
    cont_choice = cont["response"]["body"]["choices"][0]
    assert cont_choice["text"] == prompt + plain_choice["text"]
    assert cont_choice["logprobs"]["token_logprobs"][n_prompt:] == plain_choice["logprobs"]["token_logprobs"]
    assert len(cont_choice["logprobs"]["tokens"]) == n_prompt + 3
    assert chat["response"]["status_code"] == 400 and "echo" in chat["response"]["body"]["error"]["message"]
    assert zero["response"]["status_code"] == 400 and "max_tokens" in zero["response"]["body"]["error"]["message"]


def test_logit_bias_is_served_and_a_bad_one_is_its_lines_error(model):
    """A line's logit_bias (JSON keys: strings of token ids) steers its tokens; a bias on a token id past the vocabulary
    (refused when the request is added) or on a key that is no token id answers that line with an error, and the
    lines around it complete."""
    biased = {"77": 100}
    lines = [{"id": "a", "prompt": "Hello", "max_tokens": 4, "logit_bias": biased, "return_token_ids": True},
             {"id": "vocab", "prompt": "Hello", "logit_bias": {"77": 1, "999999999": -1}},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Hello", "max_tokens": 4, "logit_bias": biased, "return_token_ids": True}},
             {"custom_id": "key", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"hello": 5}}},
             {"id": "plain", "prompt": "Hello", "max_tokens": 4, "return_token_ids": True}]
    r = nv(model, "-", "--ignore-eos", "-q", input="".join(json.dumps(x) + "\n" for x in lines))
    assert r.exit_code == 1, r.stderr  # some lines failed
    a, vocab, b, key, plain = jsonl(r.stdout)
    assert a["token_ids"] == [77] * 4 and "error" not in a
    assert b["response"]["status_code"] == 200 and b["response"]["body"]["choices"][0]["text"] == a["text"]
    assert plain["token_ids"] != [77] * 4 and plain["usage"]["completion_tokens"] == 4
    assert vocab["error"]["type"] == "invalid_request"
    assert "logit_bias: token id(s) 999999999 are outside the vocabulary" in vocab["error"]["message"]
    assert key["response"]["status_code"] == 400
    assert "body.logit_bias: keys must be token ids" in key["response"]["body"]["error"]["message"]


def test_a_constraint_nv_cannot_serve_is_its_lines_error(model):
    """A response_format type nv lacks, or two constraints on one line, answers that line with one error line (a 400
    in an OpenAI request); the lines around it complete."""
    lines = [{"id": "before", "prompt": "Hello", "max_tokens": 2},
             {"custom_id": "xml", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "xml"}}},
             {"id": "two", "prompt": "Hello", "guided_regex": "a+", "guided_choice": ["a"]},
             {"id": "after", "prompt": "Hello", "max_tokens": 2}]
    r = nv(model, "-", "--ignore-eos", "-q", input="".join(json.dumps(x) + "\n" for x in lines))
    assert r.exit_code == 1, r.stderr
    before, xml, two, after = jsonl(r.stdout)
    assert (before["id"], after["id"]) == ("before", "after")
    assert before["usage"]["completion_tokens"] == after["usage"]["completion_tokens"] == 2
    assert xml["custom_id"] == "xml" and xml["response"]["status_code"] == 400
    assert xml["response"]["body"]["error"]["message"] == (
        "body.response_format.type 'xml' is not supported: nv serves \"text\", \"json_object\", \"json_schema\", "
            "\"structural_tag\"")
    assert two["error"]["type"] == "invalid_request"
    assert two["error"]["message"] == "give one output constraint per line (got 2: guided_regex, guided_choice)"


def test_tool_choice_required_and_named_give_parseable_calls_from_a_random_model(model):
    """The constraint of tool_choice "required" and of a named function gives calls of the tools' shape even from a
    random model (compact JSON, so it cannot wander off into whitespace); "auto" serves the text it gets, reading it
    with the hermes parser that Qwen3's template calls for."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
    now = {"type": "function", "function": {"name": "now", "description": "The time"}}
    compact = {"disable_any_whitespace": True}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    lines = [
        {"custom_id": "required", "url": "/v1/chat/completions", "method": "POST", "body": {
            "messages": messages, "tools": [weather, now], "tool_choice": "required", "structured_outputs": compact}},
        {"custom_id": "named", "url": "/v1/chat/completions", "method": "POST", "body": {
            "messages": messages, "tools": [weather, now], "structured_outputs": compact,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}},
        {"id": "native", "messages": messages, "tools": [weather], "tool_choice": "required",
         "parallel_tool_calls": False, "structured_outputs": compact},
        {"id": "auto", "messages": messages, "tools": [weather, now], "max_tokens": 8},
    ]
    r = nv(model, "-", "-q", "--no-thinking", "--max-tokens", 60, input="".join(json.dumps(x) + "\n" for x in lines))
    assert r.exit_code == 0, r.stderr
    required, named, native, auto = jsonl(r.stdout)

    def check(call: dict) -> str:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        if name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 6
        else:
            assert name == "now" and args == {}
        return name

    for line in (required, named):
        choice = line["response"]["body"]["choices"][0]
        assert choice["message"]["content"] == "" and choice["message"]["tool_calls"], choice
        names = [check(c) for c in choice["message"]["tool_calls"]]
        if line is named:
            assert names == ["get_weather"] and choice["finish_reason"] == "stop"
        else:
            assert choice["finish_reason"] == "tool_calls"
    assert native["finish_reason"] == "tool_calls" and [check(c) for c in native["tool_calls"]] == ["get_weather"]
    assert json.loads(native["text"])[0]["name"] == "get_weather"  # the raw text is the constrained array
    assert auto["usage"]["completion_tokens"] == 8 and isinstance(auto["tool_calls"], list)


def test_ordered_and_unordered_agree_by_id(model, tmp_path):
    src = write(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Item {i}:", "max_tokens": 1 + (7 * i) % 9}
                                        for i in range(16)])
    a = nv(model, src, "--ignore-eos", "--max-num-seqs", 4, "-q")
    b = nv(model, src, "--ignore-eos", "--max-num-seqs", 4, "--unordered", "-q")
    assert a.exit_code == b.exit_code == 0
    la, lb = jsonl(a.stdout), jsonl(b.stdout)
    assert [x["id"] for x in la] == [f"r{i}" for i in range(16)]
    assert [x["id"] for x in lb] != [x["id"] for x in la]  # short requests overtook long ones
    assert {x["id"]: x for x in la} == {x["id"]: x for x in lb}


def test_good_and_bad_lines_one_output_each(model, tmp_path):
    src = write(tmp_path / "mixed.jsonl", [
        {"id": "good-1", "prompt": "Hello"},
        '{"id": "torn", "prompt": "Hel',
        {"id": "wrong-type", "prompt": "Hello", "max_tokens": "lots"},
        {"id": "empty", "prompt": ""},
        {"id": "no-prompt", "temperature": 0},
        {"id": "too-long", "prompt": "word " * 200},
        {"id": "bad-token", "prompt_token_ids": [10**9]},
        {"id": "good-1", "prompt": "duplicate id"},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "good-2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}},
        "",
        {"id": "good-3", "messages": [{"role": "user", "content": "Hi"}]},
    ])
    out = tmp_path / "out.jsonl"
    r = runner.invoke(app, ["generate", str(src), "-o", str(out), "--model", model, "--device", "cpu",
                            "--num-kvcache-blocks", "64", "--max-model-len", "128", "--max-tokens", "4"])
    assert r.exit_code == 1, r.stderr
    lines = jsonl(out.read_text())
    assert len(lines) == 11  # 12 lines, one blank
    ids = [x["id"] for x in lines]
    assert ids == ["good-1", None, "wrong-type", "empty", "no-prompt", "too-long", "bad-token", "good-1", "bad-url",
                   "good-2", "good-3"]
    kinds = [x["error"]["type"] if x.get("error") else None for x in lines]
    assert kinds == [None, "invalid_json", "invalid_request", "invalid_request", "invalid_request", "prompt_too_long",
                     "invalid_request", "duplicate_id", None, None, None]
    assert "max_model_len" in lines[5]["error"]["message"]
    bad_url = lines[8]
    assert bad_url["response"]["status_code"] == 400 and "unknown url" in bad_url["response"]["body"]["error"]["message"]
    assert lines[9]["response"]["status_code"] == 200
    assert "duplicate_id" in r.stderr and "prompt_too_long" in r.stderr  # the summary, by kind


def test_a_line_with_extreme_sampling_values_does_not_end_the_job(model):
    """Values a line may legally give (a top_k past the vocabulary, a top_p that is 0 in float32) are served, and
    one of the wrong type is that line's error: none of them may stop the job (they used to, in engine.step)."""
    lines = [{"id": "k", "prompt": "a", "top_k": 1e20, "temperature": 1.0, "seed": 1},
             {"id": "p", "prompt": "a", "top_p": 1e-300, "temperature": 1.0, "max_tokens": 3, "return_token_ids": True},
             {"id": "g", "prompt": "a", "max_tokens": 3, "return_token_ids": True},
             {"id": "s", "prompt": "a", "skip_special_tokens": 0},
             {"id": "after", "prompt": "b"}]
    r = nv(model, "-", "--max-tokens", 3, "-q", input="".join(json.dumps(x) + "\n" for x in lines))
    assert r.exit_code == 1, r.stderr
    out = {x["id"]: x for x in jsonl(r.stdout)}
    assert list(out) == ["k", "p", "g", "s", "after"]
    assert "text" in out["k"] and "text" in out["after"]
    assert out["p"]["token_ids"] == out["g"]["token_ids"]  # nothing but the most likely token: greedy
    assert out["s"]["error"]["type"] == "invalid_request" and "skip_special_tokens" in out["s"]["error"]["message"]


def test_usage_errors_exit_2(model, tmp_path):
    src = write(tmp_path / "in.jsonl", [{"prompt": "x"}])
    cases = [
        (["generate", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["generate", str(src), "--model", str(tmp_path / "no-such-model")], "no-such-model"),
        (["generate", str(src), "--model", model, "--device", "cpu", "--max-model-len", "10000000"], "--max-model-len"),
        (["generate", str(src), "--model", model, "--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
        (["generate", str(src), "--model", model, "--top-p", "0"], "--top-p"),
        (["generate", str(src), "--tp", "x"], "--tensor-parallel-size"),
        (["generate", str(src), "--model", model, "--json-schema", str(tmp_path / "no-schema.json")],
         "--json-schema: file"),
    ]
    for argv, words in cases:
        r = runner.invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)
        assert words in r.output and "Traceback" not in r.output, r.output


def test_dashboard_with_real_engine_stats(model):
    """The Live dashboard renders the real engine's stats (KV bar, throughput) on a terminal console."""
    import io

    from rich.console import Console

    from nvcli.config import EngineConfig
    from nvcli.dashboard import LiveDashboard, render_dashboard
    from nvcli.engine.llm_engine import LLMEngine
    from nvcli.jobs import Defaults, JobOptions, run_job

    engine = LLMEngine(EngineConfig(model=model, device="cpu", num_kvcache_blocks=64, max_model_len=256))
    console = Console(record=True, force_terminal=True, width=100, file=io.StringIO())
    dash = LiveDashboard(console, refresh_s=0.0)
    data = "".join(json.dumps({"prompt": f"Count to {i}:", "max_tokens": 12}) + "\n" for i in range(8)).encode()
    out = io.BytesIO()
    dash.start()
    result = run_job(engine, io.BytesIO(data), out,
                     JobOptions(defaults=Defaults(sampling={"temperature": 0, "ignore_eos": True}), handle_sigint=False,
                                model_name="tiny"), reporter=dash)
    dash.stop()
    engine.shutdown()
    assert result.written == 8 and b"\x1b" not in out.getvalue()
    assert dash.last is not None
    frame = Console(record=True, force_terminal=True, width=100, file=io.StringIO())
    frame.print(render_dashboard(*dash.last))
    text = frame.export_text()
    assert "KV cache" in text and "/ 64 blocks" in text and "generation" in text and "nv generate · tiny" in text


# -- as a user runs it (subprocesses) ----------------------------------------------------------
def test_shell_pipeline_stdin_to_stdout_and_head(model, tmp_path):
    src = write(tmp_path / "in.jsonl", [{"id": i, "prompt": f"Line {i}", "max_tokens": 3} for i in range(40)])
    cmd = " ".join([*nv_argv(), "generate", "-", "--model", model, *FAST, "--max-num-seqs", "4"])
    # a full pipeline: cat | nv | cat, stdout must be pure JSONL
    p = subprocess.run(["bash", "-c", f"set -o pipefail; cat {src} | {cmd} | cat"], capture_output=True,
                       env=subprocess_env(), timeout=300)
    assert p.returncode == 0, p.stderr.decode()
    assert b"\x1b" not in p.stdout
    lines = jsonl(p.stdout.decode())
    assert [x["id"] for x in lines] == list(range(40)) and all(x["usage"]["completion_tokens"] == 3 for x in lines)
    assert b"summary" in p.stderr  # stderr is not a terminal: plain progress and the summary
    # | head -1: the reader goes away; nv stops quietly
    p = subprocess.run(["bash", "-c", f"cat {src} | {cmd} | head -1; echo \"status=${{PIPESTATUS[1]}}\" >&2"],
                       capture_output=True, env=subprocess_env(), timeout=300)
    assert len(p.stdout.splitlines()) == 1 and json.loads(p.stdout)["id"] == 0
    err = p.stderr.decode()
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert "status=141" in err  # 128 + SIGPIPE, as other Unix tools report it


def test_sigkill_then_resume_then_ctrl_c_then_resume(model, tmp_path):
    n = 48
    src = write(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} plus {i}?"}
                                        for i in range(n)])
    out = tmp_path / "out.jsonl"
    base = [*nv_argv(), "generate", str(src), "-o", str(out), "--model", model, *FAST, "--max-tokens", "6",
            "--ignore-eos"]

    def start(*extra: str) -> subprocess.Popen:
        return subprocess.Popen([*base, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())

    def wait_for_lines(proc: subprocess.Popen, k: int) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= k:
                return
            time.sleep(0.05)
        rc = proc.poll()
        proc.kill()
        raise AssertionError(f"no {k} lines in time; rc={rc}; stderr: {proc.communicate()[1].decode()[-2000:]}")

    # 1. SIGKILL mid-job, then tear the last line as a kill mid-write would
    proc = start("--max-num-seqs", "2", "-q")
    wait_for_lines(proc, 4)
    proc.kill()
    proc.wait()
    done = out.read_text().splitlines()
    assert 4 <= len(done) < n
    with open(out, "a") as f:
        f.write('{"id": "q999", "text": "half a li')
    # 2. --resume, interrupted by Ctrl-C: drains what is in flight, exits 130
    proc = start("--max-num-seqs", "2", "--max-in-flight", "4", "--resume")
    wait_for_lines(proc, len(done) + 2)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()
    assert b"torn last line" in err and b"Traceback" not in err
    mid = jsonl(out.read_text())
    assert len(mid) < n and len({x["id"] for x in mid}) == len(mid)
    # 3. --resume to the end (in-process)
    r = runner.invoke(app, ["generate", str(src), "-o", str(out), "--model", model, *FAST, "--max-tokens", "6",
                            "--ignore-eos", "--resume", "--max-num-seqs", "64"])
    assert r.exit_code == 0, r.stderr
    final = jsonl(out.read_text())  # every line parses: nothing torn
    assert sorted(x["id"] for x in final) == sorted(f"q{i}" for i in range(n))  # none lost, none twice
    assert all(x["usage"]["completion_tokens"] == 6 for x in final)
    assert final[: len(mid)] == mid  # earlier answers kept as they were


def test_ctrl_c_with_stdin_still_open(model, tmp_path):
    """`producer | nv generate -`: Ctrl-C while nv waits for more input; finished lines are out, exit 130."""
    proc = subprocess.Popen([*nv_argv(), "generate", "-", "--model", model, *FAST, "--max-tokens", "3"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b'{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')
    proc.stdin.flush()
    got = [json.loads(proc.stdout.readline()) for _ in range(2)]  # answered while the pipe stays open
    assert [x["id"] for x in got] == ["a", "b"]
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=120)  # stdin stays open meanwhile: nv's reader is blocked reading it
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdin.close()
    assert rc == 130, err.decode()
    assert out == b"" and b"Fatal Python error" not in err and b"Traceback" not in err


def test_truncate_prompt_tokens_keeps_a_too_long_prompt_s_last_tokens(model):
    """vLLM's truncate_prompt_tokens, per line or by flag: a prompt longer than k keeps its last k tokens (the line
    is served, usage counts what the model read, an echo shows those tokens' text); -1 keeps as many as fit; without
    it the same line is an error line. A flag at or past --max-model-len stops the job at once."""
    long_ids = list(range(100, 700))  # 600 tokens against FAST's --max-model-len 512
    data = "".join(json.dumps(x) + "\n" for x in [
        {"id": "cut", "prompt_token_ids": long_ids, "truncate_prompt_tokens": 10, "max_tokens": 2},
        {"id": "fit", "prompt_token_ids": long_ids, "truncate_prompt_tokens": -1, "max_tokens": 2},
        {"id": "short", "prompt_token_ids": long_ids[:5], "truncate_prompt_tokens": 10, "max_tokens": 2},
        {"id": "same", "prompt_token_ids": long_ids[-10:], "max_tokens": 2},
        {"id": "whole", "prompt_token_ids": long_ids, "max_tokens": 2},
        {"id": "wide", "prompt_token_ids": long_ids, "truncate_prompt_tokens": 512},
        {"custom_id": "echo", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "one two three four five six seven", "truncate_prompt_tokens": 3, "echo": True,
                  "max_tokens": 0, "logprobs": 0}},
    ])
    r = nv(model, "-", "-q", "--ignore-eos", input=data)
    assert r.exit_code == 1 and "2 lines failed" in r.stderr
    cut, fit, short, same, whole, wide, echo = jsonl(r.stdout)
    assert cut["usage"]["prompt_tokens"] == 10 and cut["text"] == same["text"]  # it read the same 10 tokens
    assert fit["usage"]["prompt_tokens"] == 510 and short["usage"]["prompt_tokens"] == 5
    assert whole["error"]["type"] == "prompt_too_long"
    assert wide["error"]["type"] == "invalid_request" and "truncate_prompt_tokens" in wide["error"]["message"]
    choice = echo["response"]["body"]["choices"][0]
    assert echo["response"]["body"]["usage"]["prompt_tokens"] == 3
    assert choice["text"] == " five six seven" and "".join(choice["logprobs"]["tokens"]) == choice["text"]
    flag = nv(model, "-", "-q", "--truncate-prompt-tokens", "512", input=data)
    assert flag.exit_code == 2 and "--truncate-prompt-tokens" in flag.output
    bad = nv(model, "-", "-q", "--truncate-prompt-tokens", "0", input=data)
    assert bad.exit_code == 2 and "--truncate-prompt-tokens" in bad.output


def test_reasoning_parser_splits_chat_lines_and_constrains_their_answers(model):
    """--reasoning-parser qwen3: a chat line's output constraint starts after </think> (here the first token, by a
    bias) and "reasoning" is split off; a line with thinking off is constrained from its first token and its text is
    all answer; a prompt line is left whole. An unknown parser is a usage error."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("</think>")
    ask = [{"role": "user", "content": "yes or no?"}]
    data = "".join(json.dumps(x) + "\n" for x in [
        {"custom_id": "think", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": ask, "guided_choice": ["yes", "no"], "logit_bias": {str(end): 100}, "max_tokens": 8}},
        {"id": "off", "messages": ask, "chat_template_kwargs": {"enable_thinking": False},
         "guided_choice": ["yes", "no"], "max_tokens": 8},
        {"id": "prompt", "prompt": "yes or no?", "max_tokens": 2},
    ])
    r = nv(model, "-", "-q", "--reasoning-parser", "qwen3", input=data)
    assert r.exit_code == 0, r.output
    think, off, prompt = jsonl(r.stdout)
    message = think["response"]["body"]["choices"][0]["message"]
    assert message["reasoning"] == "" and message["content"] in ("yes", "no"), message
    assert off["reasoning"] is None and off["text"] in ("yes", "no"), off
    assert "reasoning" not in prompt
    bad = nv(model, "-", "-q", "--reasoning-parser", "granite", input=data)
    assert bad.exit_code == 2 and "--reasoning-parser: must be one of qwen3, deepseek_r1" in bad.output
    alone = nv(model, "-", "-q", "--structured-outputs-in-reasoning", input=data)
    assert alone.exit_code == 2 and "--structured-outputs-in-reasoning: needs --reasoning-parser" in alone.output


def test_unusable_settings_are_one_line_errors_not_tracebacks(model, tmp_path, monkeypatch):
    """--device cuda without CUDA (generate and bench), a corrupt or truncated GGUF file and a cache directory that
    cannot be made: exit 2 with one `nv: error:` line naming the problem."""
    import torch

    from nvcli.models.resolve import default_model_gguf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    src = write(tmp_path / "in.jsonl", [{"prompt": "x"}])
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 50)
    whole = default_model_gguf().read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[: len(whole) // 2])
    cases = [
        (["generate", str(src), "--device", "cuda"], "--device: cuda: "),
        (["bench", "--device", "cuda", "--latency"], "--device: cuda: "),
        (["generate", str(src), "--model", str(bad)], "not a valid GGUF file"),
        (["generate", str(src), "--model", str(truncated)], "not a valid GGUF file, or a truncated one"),
    ]
    for argv, words in cases:
        r = runner.invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)
        assert words in r.stderr and "Traceback" not in r.output, r.output
        assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1, r.stderr


@pytest.mark.parametrize("var, below", [("XDG_CACHE_HOME", ""), ("NV_CACHE_DIR", "x")])
def test_a_cache_dir_that_cannot_be_made_is_a_one_line_error(tmp_path, monkeypatch, var, below):
    """The default model is converted into nv's cache: a cache directory below a file stops the job at once."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.delenv("NV_CACHE_DIR", raising=False)
    monkeypatch.setenv(var, str(a_file / below) if below else str(a_file))
    src = write(tmp_path / "in.jsonl", [{"prompt": "x"}])
    r = runner.invoke(app, ["generate", str(src), "-q", "--max-tokens", "1"])
    assert r.exit_code == 2, r.output
    assert "nv's cache directory" in r.stderr and "Not a directory" in r.stderr and "Traceback" not in r.output


def test_help_at_80_columns_keeps_every_flag_name_whole():
    """Rich's panels cut --tensor-parallel-… and --gpu-memory-utili… at 80 columns; click's help wraps the text."""
    import click

    for command in ("generate", "bench"):
        r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"})
        assert r.exit_code == 0 and "…" not in r.stdout
        assert max(map(len, r.stdout.splitlines())) <= 80
        params = typer.main.get_command(app).commands[command].params  # type: ignore[attr-defined]
        for name in (opt for p in params if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)):
            assert re.search(rf"(^|[\s,]){re.escape(name)}([\s,=]|$)", r.stdout, re.M), (command, name)
    assert "SmolLM2-135M-Instruct" in runner.invoke(app, ["generate", "--help"]).stdout  # --model's default


def test_generate_without_input_says_the_argument_is_missing():
    r = runner.invoke(app, ["generate"])
    assert r.exit_code == 2 and "Missing argument 'INPUT'" in r.output and "Options:" not in r.output


def test_version():
    from nvcli import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout == f"nv {__version__}\n"
