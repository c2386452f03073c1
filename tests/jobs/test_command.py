"""`nv generate` through Typer's CliRunner, on the fake engine (fast; the real engine is in tests/test_cli.py)."""

from __future__ import annotations

import json
import os

import pytest
from fake_engine import FakeEngine
from typer.testing import CliRunner

from nvcli.cli import app
from nvcli.config import ConfigError

runner = CliRunner()


@pytest.fixture
def engines(monkeypatch):
    made: list[FakeEngine] = []

    def make(config):
        if config.model == "missing":
            raise ConfigError("--model: no model 'missing' found: looked in ./missing and the HF cache")
        e = FakeEngine(max_model_len=config.max_model_len or 200, max_num_seqs=config.max_num_seqs)
        e.config = config
        made.append(e)
        return e

    monkeypatch.setattr("nvcli.jobs.command.make_engine", make)
    return made


def write_jsonl(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def nv(*args, input=None):
    return runner.invoke(app, ["generate", *map(str, args)], input=input)


def test_file_to_file(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}", "max_tokens": 1 + i} for i in range(5)])
    out = tmp_path / "out.jsonl"
    r = nv(src, "-o", out, "--max-tokens", 3, "--temperature", 0, "--max-num-seqs", 2)
    assert r.exit_code == 0, r.output
    lines = read_jsonl(out)
    assert [x["id"] for x in lines] == [1, 2, 3, 4, 5]
    assert [x["usage"]["completion_tokens"] for x in lines] == [1, 2, 3, 4, 5]  # per-line max_tokens wins
    assert r.stdout == ""
    assert "summary" in r.stderr and "succeeded" in r.stderr
    assert engines[0].config.max_num_seqs == 2


def test_stdin_to_stdout_has_only_jsonl(engines):
    data = "".join(json.dumps({"id": f"x{i}", "prompt": "hello"}) + "\n" for i in range(4))
    r = nv("-", "--max-tokens", 2, input=data)
    assert r.exit_code == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["id"] for x in lines] == ["x0", "x1", "x2", "x3"]
    assert "\x1b" not in r.stdout


def test_flags_become_defaults_and_lines_override(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "chat-think", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": True}},
        {"id": "plain", "prompt": "abc", "return_token_ids": False, "ignore_eos": False},
    ])
    r = nv(src, "--no-thinking", "--max-tokens", 2, "--return-token-ids", "--stop", "zz", "--stop", "yy", "--quiet")
    assert r.exit_code == 0, r.stderr
    chat, think, plain = (json.loads(x) for x in r.stdout.splitlines())
    assert chat["usage"]["prompt_tokens"] == len("<user>hi<assistant><nothink>")
    assert think["usage"]["prompt_tokens"] == len("<user>hi<assistant>")
    assert "token_ids" in chat and "token_ids" not in plain
    assert r.stderr == ""  # --quiet


def test_unordered_flag(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}", "max_tokens": 12 - i} for i in range(10)])
    r = nv(src, "--unordered", "--max-num-seqs", 10, "-q")
    ids = [json.loads(x)["id"] for x in r.stdout.splitlines()]
    assert r.exit_code == 0 and sorted(ids) == list(range(1, 11)) and ids != list(range(1, 11))


def test_bad_lines_exit_1_with_summary(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "ok"}, "{not json", {"prompt": ""}, ""])
    r = nv(src, "-o", tmp_path / "out.jsonl", "--max-tokens", 2)
    assert r.exit_code == 1
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert len(lines) == 3 and [("error" in x) for x in lines] == [False, True, True]
    assert "failed" in r.stderr and "invalid_json" in r.stderr and "blank lines skipped" in r.stderr
    r = nv(src, "-o", tmp_path / "out.jsonl", "--max-tokens", 2, "--quiet")
    assert r.exit_code == 1 and "2 lines failed" in r.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["nope.jsonl"], "does not exist"),
        (["IN", "--temperature", "hot"], "temperature"),
        (["IN", "--resume"], "--resume needs an output file"),
        (["IN", "--chat-template-kwargs", "{bad"], "not valid JSON"),
        (["IN", "--block-size", "3"], "--block-size"),
        (["IN", "--temperature", "-1"], "--temperature"),
        (["IN", "--model", "missing"], "no model 'missing' found"),
        (["IN", "--no-such-flag"], "No such option"),
        (["IN", "-o", "OUTDIR/nodir/out.jsonl"], "does not exist"),
        (["IN", "-o", "IN"], "the output file is the input file"),
        (["IN", "--tool-call-parser", "mistral"],
         "--tool-call-parser: must be one of auto, hermes, llama3_json, qwen3_coder, qwen3_xml (got 'mistral')"),
    ],
)
def test_usage_errors_exit_2(tmp_path, engines, args, words):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    args = [a.replace("IN", str(src)).replace("OUTDIR", str(tmp_path)) for a in args]
    r = nv(*args)
    assert r.exit_code == 2, (args, r.output)
    assert words in r.output, r.output
    assert "Traceback" not in r.output


def test_resume_repairs_torn_line_and_completes(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(8)])
    out = tmp_path / "out.jsonl"
    assert nv(src, "-o", out, "--max-tokens", 2, "-q").exit_code == 0
    full = out.read_text().splitlines()
    # simulate a run killed mid-write: 3 whole lines and half of the 4th
    out.write_text("\n".join(full[:3]) + "\n" + full[3][: len(full[3]) // 2])
    r = nv(src, "-o", out, "--max-tokens", 2, "--resume")
    assert r.exit_code == 0, r.output
    assert "torn last line" in r.stderr
    lines = read_jsonl(out)
    assert [x["id"] for x in lines] == [f"r{i}" for i in range(8)]
    assert lines == [json.loads(x) for x in full]
    # nothing left to do: resuming again changes nothing
    r = nv(src, "-o", out, "--max-tokens", 2, "--resume", "-q")
    assert r.exit_code == 0 and read_jsonl(out) == lines


def test_resume_refuses_a_foreign_file(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    out = tmp_path / "out.jsonl"
    out.write_text("this is not jsonl\n{\"id\": 1}\n")
    r = nv(src, "-o", out, "--resume")
    assert r.exit_code == 2 and "line 1" in r.output


def test_help_lists_vllm_flags():
    r = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for flag in ("--tensor-parallel-size", "-tp", "--max-model-len", "--gpu-memory-utilization", "--max-num-seqs",
                 "--max-num-batched-tokens", "--enforce-eager", "--no-enable-prefix-caching", "--dtype", "--seed",
                 "--kv-cache-dtype", "--block-size", "--load-format", "--device", "--num-kvcache-blocks",
                 "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--stop", "--ignore-eos",
                 "--logprobs", "--chat-template-kwargs", "--no-thinking", "--json-schema", "--unordered", "--resume",
                 "--quiet", "--tool-call-parser"):
        assert flag in r.stdout, flag


def test_engine_failure_mid_job_is_reported_without_traceback(tmp_path, monkeypatch):
    class Dying(FakeEngine):
        def step(self):
            if self.st.num_steps >= 3:
                raise RuntimeError("tensor-parallel worker 1 died (exit code -9)")
            return super().step()

    monkeypatch.setattr("nvcli.jobs.command.make_engine", lambda config: Dying(max_num_seqs=1))
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}", "max_tokens": 1} for i in range(10)])
    out = tmp_path / "out.jsonl"
    r = nv(src, "-o", out, "-q")
    assert r.exit_code == 1
    assert "worker 1 died" in r.stderr and "--resume" in r.stderr and "Traceback" not in r.stderr
    assert len(read_jsonl(out)) == 3  # what finished before is kept


def test_model_generation_config_gives_sampling_defaults(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                          "repetition_penalty": 1.05}))
    made = []

    def make(config):
        e = FakeEngine()
        e.model_dir = model_dir
        made.append(e)
        return e

    monkeypatch.setattr("nvcli.jobs.command.make_engine", make)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b", "temperature": 0, "top_k": 5}])
    r = nv(src, "--top-p", "0.5", "--max-tokens", 1)
    assert r.exit_code == 0
    assert "generation_config.json" in r.stderr and "temperature=0.6" in r.stderr
    a, b = made[0].sampling_seen
    assert (a.temperature, a.top_p, a.top_k) == (0.6, 0.5, 20)  # the model's, but the flag wins for top_p
    assert (b.temperature, b.top_p, b.top_k) == (0, 0.5, 5)  # and the line wins over both
    assert a.repetition_penalty == b.repetition_penalty == 1.05  # as vLLM's --generation-config auto


def test_an_unreadable_line_takes_no_other_lines_id(tmp_path, engines):
    """A line that is not JSON has no id to give its error line: it answers with `"id": null` and its line number,
    and a later line whose id equals that line number is still served (it used to be refused as a duplicate)."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, "{oops", {"id": 1, "prompt": "y"},
                                              '{"id": 2, "prompt": "z",}', {"id": 3, "prompt": "w"}])
    out = tmp_path / "out.jsonl"
    assert nv(src, "-o", out, "--max-tokens", 2, "-q").exit_code == 1
    lines = read_jsonl(out)
    assert [x["id"] for x in lines] == ["a", None, 1, None, 3]
    assert [x["error"]["line"] for x in lines if x["id"] is None] == [2, 4]
    assert all(x["error"]["type"] == "invalid_json" for x in lines if x["id"] is None)
    assert all("text" in x for x in lines if x["id"] is not None)
    # --resume answers each input line once: the null-id error lines are matched by line number
    assert nv(src, "-o", out, "--max-tokens", 2, "--resume", "-q").exit_code == 1
    assert read_jsonl(out) == lines


def test_a_duplicate_names_the_line_that_has_the_id(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}, {"id": 1, "prompt": "y"}, {"id": "k", "prompt": "z"},
                                              {"id": "k", "prompt": "again"}])
    out = tmp_path / "out.jsonl"
    assert nv(src, "-o", out, "--max-tokens", 2, "-q").exit_code == 1
    lines = read_jsonl(out)
    assert [x["id"] for x in lines] == [1, 1, "k", "k"]
    assert "line 1 already has it (a line without an id takes its line number)" in lines[1]["error"]["message"]
    assert "line 3 already has it; ids must be unique" in lines[3]["error"]["message"]


def test_resume_serves_an_unanswered_line_whose_duplicate_was_answered(tmp_path, engines):
    """A job killed while the first line with id "x" was in flight, after its duplicate's error line was written
    (unordered): the error line answers the duplicate, not "x", so --resume still serves the first line, once."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "slow"}, {"id": "x", "prompt": "dup"},
                                              {"id": "y", "prompt": "o"}])
    out = tmp_path / "out.jsonl"
    assert nv(src, "-o", out, "--max-tokens", 2, "--unordered", "-q").exit_code == 1
    lines = read_jsonl(out)
    dup = next(x for x in lines if x.get("error"))
    answer_x = next(x for x in lines if x["id"] == "x" and "text" in x)
    out.write_text("".join(json.dumps(x) + "\n" for x in lines if x is not answer_x))  # "x" never finished
    r = nv(src, "-o", out, "--max-tokens", 2, "--unordered", "--resume", "-q")
    assert r.exit_code == 1, r.output
    after = read_jsonl(out)
    assert len(after) == 3 and after.count(dup) == 1
    assert [x for x in after if x["id"] == "x" and "text" in x] == [answer_x]


def test_retry_errors_serves_failed_lines_again(tmp_path, engines):
    """--resume keeps error lines as answers; --retry-errors takes them out and serves those lines again, e.g. once
    the --max-model-len a prompt_too_long line asked for is raised."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "short", "prompt": "x"}, {"id": "long", "prompt": "y" * 80},
                                              "{oops"])
    out = tmp_path / "out.jsonl"
    assert nv(src, "-o", out, "--max-tokens", 2, "--max-model-len", 50, "-q").exit_code == 1
    first = read_jsonl(out)
    assert first[1]["error"]["type"] == "prompt_too_long"
    r = nv(src, "-o", out, "--max-tokens", 2, "--max-model-len", 200, "--resume")
    assert r.exit_code == 1 and "--retry-errors" in r.stderr and read_jsonl(out) == first
    r = nv(src, "-o", out, "--max-tokens", 2, "--max-model-len", 200, "--resume", "--retry-errors")
    assert r.exit_code == 1 and "took out 2 error lines" in r.stderr, r.stderr
    after = read_jsonl(out)
    assert after[0] == first[0] and len(after) == 3
    assert "text" in next(x for x in after if x["id"] == "long")  # served this time
    assert next(x for x in after if x["id"] is None)["error"]["type"] == "invalid_json"  # still broken: one line
    assert not list(tmp_path.glob(".out.jsonl*"))  # no scratch file left behind
    assert nv(src, "-o", out, "--retry-errors").exit_code == 2


@pytest.mark.parametrize("redirect,words", [(">&-", "stdout is closed"), ("<&-", "stdin is closed")])
def test_a_closed_stdout_or_stdin_is_a_usage_error(tmp_path, redirect, words):
    """`nv generate in.jsonl >&-` (or `- <&-`): a message before any model loads, not a traceback after."""
    import subprocess
    import sys

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    arg = "-" if redirect == "<&-" else str(src)
    r = subprocess.run(["bash", "-c", f"{sys.executable} -m nvcli generate {arg} -q --model missing {redirect}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_json_schema_constrains_the_lines_that_set_no_constraint(tmp_path, engines):
    """--json-schema PATH: every line's request carries the file's schema, unless the line sets its own constraint."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "a"},
        {"prompt": "b", "guided_regex": "[0-9]+"},
        {"custom_id": "c", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "c"}], "response_format": {"type": "json_object"}}},
        {"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "d", "response_format": {"type": "text"}}},
    ])
    r = nv(src, "--json-schema", path, "--max-tokens", 1, "-q")
    assert r.exit_code == 0, r.output
    a, b, c, d = (sp.structured_outputs for sp in engines[0].sampling_seen)
    assert (a.json, b.regex, c.json_object, d.json) == (schema, "[0-9]+", True, schema)
    assert a.regex is None and b.json is None and c.json is None
    r = nv(src, "--max-tokens", 1, "-q")  # without the flag, only the lines' own constraints
    assert r.exit_code == 0, r.output
    assert engines[1].sampling_seen[0].structured_outputs is None
    assert engines[1].sampling_seen[3].structured_outputs is None


@pytest.mark.parametrize("content, words", [
    (None, "--json-schema: file 'PATH' does not exist"),
    ("{\"type\": ", "--json-schema: 'PATH' is not valid JSON"),
    ("[1, 2]", "--json-schema: 'PATH' must hold a JSON schema (an object), got a list"),
    ('{"type": "colour"}', "--json-schema: 'PATH' is not a JSON schema nv can use"),
    ('{"$ref": "#/definitions/nowhere"}', "--json-schema: 'PATH' is not a JSON schema nv can use"),
])
def test_a_bad_json_schema_file_stops_the_job_at_start_up(tmp_path, engines, content, words):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    r = nv(src, "--json-schema", path, "-q")
    assert r.exit_code == 2, r.output
    assert words.replace("PATH", str(path)) in r.output and "Traceback" not in r.output, r.output
    assert engines == []  # checked before the model loads


def test_tool_call_parser_flag_reaches_the_job(tmp_path, monkeypatch):
    """--tool-call-parser names the parser of tool_choice "auto" lines: here a model whose template shows no
    tool-call format nv knows, so without the flag the line is refused, with it the call is found."""
    def make(config):
        e = FakeEngine(max_model_len=4000, replies={"weather": '{"name": "now", "parameters": {}}'})
        e.tokenizer.chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}{{ messages }}"
        return e

    monkeypatch.setattr("nvcli.jobs.command.make_engine", make)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "t", "messages": [{"role": "user", "content": "weather?"}],
                                               "tools": [{"type": "function", "function": {"name": "now"}}]}])
    r = nv(src, "--max-tokens", 100, "-q")
    assert r.exit_code == 1 and "pass --tool-call-parser" in json.loads(r.stdout)["error"]["message"], r.output
    r = nv(src, "--max-tokens", 100, "-q", "--tool-call-parser", "llama3_json")
    assert r.exit_code == 0, r.output
    line = json.loads(r.stdout)
    assert line["finish_reason"] == "tool_calls" and line["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}


def test_batch_invariant_flag_reaches_the_engine(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    assert nv(src, "-q", "--max-tokens", 1).exit_code == 0
    assert nv(src, "-q", "--max-tokens", 1, "--batch-invariant").exit_code == 0
    assert [e.config.batch_invariant for e in engines] == [False, True]


def test_batch_invariant_goes_with_tp_and_an_fp8_cache(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    r = nv(src, "-q", "--max-tokens", 1, "--batch-invariant", "--tp", 2, "--kv-cache-dtype", "fp8")
    assert r.exit_code == 0, r.output
    (config,) = [e.config for e in engines]
    assert config.batch_invariant and config.tensor_parallel_size == 2 and config.kv_cache_dtype == "fp8"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_failure_names_the_output_and_offers_no_resume_it_cannot_do(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    r = nv(src, "-o", "/dev/full", "-q", "--max-tokens", 2)
    assert r.exit_code == 1
    assert "nv: error: the job stopped: cannot write to '/dev/full': No space left on device" in r.stderr
    assert "--resume" not in r.stderr and "Traceback" not in r.output


def test_quiet_still_warns_of_unknown_fields_once_and_counts_one_failed_line(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "max_token": 3}, {"prompt": "y", "max_token": 3},
                                              {"prompt": ""}])
    r = nv(src, "-o", tmp_path / "out.jsonl", "-q", "--max-tokens", 2)
    assert r.exit_code == 1
    assert r.stderr.count("ignoring unknown field 'max_token'") == 1
    assert "nv: 1 line failed (its output line carries an error)" in r.stderr and "1 lines" not in r.stderr


def test_max_tokens_flag_beyond_the_context_is_a_usage_error(tmp_path, engines):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    r = nv(src, "--max-tokens", 100000, "--max-model-len", 64)
    assert r.exit_code == 2 and "--max-tokens: must be below --max-model-len=64 (got 100000)" in r.output


def test_debug_prints_the_resolved_settings_and_the_environment(tmp_path, engines, monkeypatch):
    """--debug: every engine setting and nv's environment settings on stderr, once the engine is built; the JSONL
    is untouched."""
    monkeypatch.setenv("NV_CACHE_DIR", str(tmp_path / "cache"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "p"}])
    r = nv(src, "--max-tokens", 2, "--max-num-seqs", 3, "--debug")
    assert r.exit_code == 0, r.output
    assert "engine settings:" in r.stderr and "max_num_seqs = 3" in r.stderr
    assert f"cache_dir = PosixPath('{tmp_path / 'cache'}')" in r.stderr
    assert [json.loads(x)["id"] for x in r.stdout.splitlines()] == [1]
    assert "engine settings" not in nv(src, "--max-tokens", 2).stderr


def test_debug_shows_an_engine_failure_as_its_traceback(tmp_path, engines, monkeypatch):
    from fake_engine import FakeEngine

    def broken_step(self):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(FakeEngine, "step", broken_step)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "p"}])
    plain = nv(src, "-o", tmp_path / "a.jsonl")
    assert plain.exit_code != 0 and "the device fell over" in plain.stderr  # one line, no traceback
    assert not isinstance(plain.exception, RuntimeError)
    debug = nv(src, "-o", tmp_path / "b.jsonl", "--debug")
    assert isinstance(debug.exception, RuntimeError) and "the device fell over" in str(debug.exception)
