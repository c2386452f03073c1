"""Static shards: `nv generate --num-shards K --shard-index I` serves the lines whose 0-based physical line number is
I mod K, and `nv merge OUT SHARD...` joins the shards' outputs in input order (on the fake engine, through Typer)."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from typer.testing import CliRunner

from nvcli.cli import app
from nvcli.jobs.requests import Defaults, parse_line, read_line_id
from nvcli.jobs.runner import JobOptions, LineCounter, run_job
from nvcli.jobs.shards import Shard, ShardError

runner = CliRunner()


@pytest.fixture
def engines(monkeypatch):
    def make(config):
        e = FakeEngine(max_model_len=config.max_model_len or 200, max_num_seqs=config.max_num_seqs)
        e.config = config
        return e

    monkeypatch.setattr("nvcli.jobs.command.make_engine", make)


def nv(*args):
    return runner.invoke(app, [*map(str, args)])


# Explicit ids, custom_ids, line-number ids, blank lines, an unreadable line, a prompt too long and a duplicate id
# within one shard (positions 2 and 14: the same shard for K = 1, 2, 3, 4 and 6).
LINES = [
    {"prompt": "p0"}, {"id": "a", "prompt": "p1"}, {"id": "k", "prompt": "p2"}, "", {"prompt": "p4", "max_tokens": 1},
    "{oops", {"id": 70, "prompt": "p6"}, {"prompt": "y" * 300}, "", {"custom_id": "c9", "prompt": "p9"},
    {"prompt": "p10"}, {"id": "b", "prompt": "p11!"}, {"id": 13, "prompt": "p12"}, {"prompt": "p13"},
    {"id": "k", "prompt": "p14"}, {"prompt": "p15"}, "   ", {"messages": [{"role": "user", "content": "hi"}]},
]


def write_input(tmp_path, lines=LINES, name="in.jsonl"):
    src = tmp_path / name
    src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return src


def run_shards(src, tmp_path, k, *flags):
    files = []
    for i in range(k):
        out = tmp_path / f"out.{i}.jsonl"
        r = nv("generate", src, "-o", out, "--max-tokens", 3, "--num-shards", k, "--shard-index", i, "-q", *flags)
        assert r.exit_code in (0, 1), r.output
        files.append(out)
    return files


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_shards_then_merge_equal_the_unsharded_output_byte_for_byte(tmp_path, engines, k):
    src = write_input(tmp_path)
    whole = tmp_path / "whole.jsonl"
    assert nv("generate", src, "-o", whole, "--max-tokens", 3, "-q").exit_code == 1  # some error lines
    files = run_shards(src, tmp_path, k)
    merged = tmp_path / "merged.jsonl"
    r = nv("merge", merged, *files, "--input", src)
    assert r.exit_code == 0, r.output
    assert merged.read_bytes() == whole.read_bytes()
    assert f"merged 15 lines from {k} shards" in r.stderr
    # each shard holds exactly its own lines, in input order, under the ids an unsharded job gives them
    wanted = [json.loads(x) for x in whole.read_text().splitlines()]
    for i, f in enumerate(files):
        got = [json.loads(x) for x in f.read_text().splitlines()]
        assert got == [x for x, p in zip(wanted, _positions()) if p % k == i]


def _positions():
    return [p for p, x in enumerate(LINES) if not (isinstance(x, str) and not x.strip())]


def test_a_shard_keeps_its_exit_code_error_lines_and_line_numbers(tmp_path, engines):
    src = write_input(tmp_path)
    ok = nv("generate", src, "-o", tmp_path / "s1.jsonl", "--num-shards", 4, "--shard-index", 1, "--max-tokens", 2, "-q")
    assert ok.exit_code == 1  # line 6, {oops, is shard 1's
    lines = [json.loads(x) for x in (tmp_path / "s1.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == ["a", None, "c9", 14, 18]  # the physical line numbers, as unsharded
    assert lines[1]["error"]["line"] == 6
    clean = nv("generate", src, "-o", tmp_path / "s0.jsonl", "--num-shards", 4, "--shard-index", 0, "--max-tokens", 2)
    assert clean.exit_code == 0 and "output lines written" in clean.stderr


def test_the_dashboard_total_and_counts_are_the_shards(tmp_path):
    src = write_input(tmp_path)
    counter = LineCounter(src, Shard(3, 0))
    counter.run()
    assert counter.total == sum(1 for p in _positions() if p % 3 == 0)
    for i in range(3):
        eng = FakeEngine()
        with open(src, "rb") as f, open(tmp_path / "o", "wb") as dst:
            res = run_job(eng, f, dst, JobOptions(handle_sigint=False, shard=Shard(3, i)))
        own = [p for p in range(len(LINES)) if p % 3 == i]
        assert res.written == sum(1 for p in own if p in _positions())
        assert res.counts.blank == sum(1 for p in own if p not in _positions())


@pytest.mark.parametrize("flags, words", [
    (["--num-shards", 0, "--shard-index", 0], "--num-shards: must be an integer of at least 1 (got 0)"),
    (["--num-shards", 2, "--shard-index", 2], "--shard-index: must be from 0 to --num-shards - 1 = 1 (got 2)"),
    (["--num-shards", 2, "--shard-index", -1], "--shard-index: must be from 0 to"),
    (["--shard-index", 1], "--shard-index: goes with --num-shards K"),
    (["--num-shards", 2], "--num-shards: goes with --shard-index I"),
])
def test_a_bad_shard_setting_fails_at_once_naming_the_flag(tmp_path, monkeypatch, flags, words):
    def no_engine(config):
        raise AssertionError("the engine was built before the flags were checked")

    monkeypatch.setattr("nvcli.jobs.command.make_engine", no_engine)
    r = nv("generate", write_input(tmp_path), *flags)
    assert r.exit_code == 2
    assert r.stderr == f"nv: error: {r.stderr.removeprefix('nv: error: ').splitlines()[0]}\n"  # one line
    assert words in r.stderr, r.stderr


def test_shard_validation_at_construction():
    assert Shard.from_flags(None, None) is None
    assert Shard.from_flags(1, 0) == Shard(1, 0) and Shard(3, 2).owns(5) and not Shard(3, 2).owns(4)
    for count, index in ((0, 0), (2, 3), (True, 0), (2, None)):
        with pytest.raises(ShardError):
            Shard(count, index)  # type: ignore[arg-type]


def test_missing_lines_are_named_with_the_owning_shard_and_resume_fills_them(tmp_path, engines):
    src = write_input(tmp_path)
    whole = tmp_path / "whole.jsonl"
    nv("generate", src, "-o", whole, "--max-tokens", 3, "-q")
    files = run_shards(src, tmp_path, 3)
    # shard 1 was killed mid-write: one whole line, then half of the next; shard 2 never ran
    s1 = files[1].read_text().splitlines(keepends=True)
    files[1].write_text(s1[0] + s1[1][:10])
    files[2].unlink()
    merged = tmp_path / "merged.jsonl"
    merged.write_text("old\n")
    r = nv("merge", merged, *files, "--input", src)
    assert r.exit_code == 1, r.output
    assert merged.read_text() == "old\n" and not list(tmp_path.glob(".merged*"))  # OUT untouched, no scratch file
    err = r.stderr
    assert "9 of 15 input lines have no output line" in err
    assert "out.1.jsonl', torn last line left out) lacks 4: id 5, id 8, id 11, id 14\n" in err
    assert ("out.2.jsonl', which does not exist) lacks 5: id 'k' (line 3), line 6 (no readable id), id 'b' (line 12), "
            "id 'k' (line 15), id 18\n") in err
    assert "--num-shards 3 --shard-index 1 --resume" in err
    for i in (1, 2):
        r = nv("generate", src, "-o", files[i], "--max-tokens", 3, "--num-shards", 3, "--shard-index", i, "--resume", "-q")
        assert r.exit_code in (0, 1), r.output
    r = nv("merge", merged, *files, "-i", src)
    assert r.exit_code == 0, r.output
    assert merged.read_bytes() == whole.read_bytes()


def test_shards_out_of_input_order_merge_in_order(tmp_path, engines):
    """--unordered shards, and a shard whose error lines --retry-errors served again at its end."""
    src = write_input(tmp_path)
    whole = tmp_path / "whole.jsonl"
    nv("generate", src, "-o", whole, "--max-tokens", 3, "-q")
    files = run_shards(src, tmp_path, 2, "--unordered", "--max-num-seqs", 8)
    r = nv("generate", src, "-o", files[1], "--max-tokens", 3, "--num-shards", 2, "--shard-index", 1, "--resume",
           "--retry-errors", "-q")
    assert r.exit_code == 1, r.output
    last = [json.loads(x)["id"] for x in files[1].read_text().splitlines()[-2:]]
    assert sorted(last, key=str) == [8, None]  # its error lines ({oops, a prompt too long), served again at its end
    merged = tmp_path / "merged.jsonl"
    assert nv("merge", merged, *files, "--input", src).exit_code == 0
    assert merged.read_bytes() == whole.read_bytes()


def test_merge_without_input_places_lines_by_their_line_numbers(tmp_path, engines):
    lines = [{"prompt": f"p{i}"} if i % 4 else "" for i in range(10)] + ["{oops", {"prompt": "y" * 300}]
    src = write_input(tmp_path, lines)
    whole = tmp_path / "whole.jsonl"
    nv("generate", src, "-o", whole, "--max-tokens", 3, "-q")
    files = run_shards(src, tmp_path, 3)
    r = runner.invoke(app, ["merge", "-", *map(str, files)])
    assert r.exit_code == 0, r.output
    assert r.stdout == whole.read_text()
    assert "without --input" in r.stderr
    # a string id does not say where its line goes
    src = write_input(tmp_path, LINES)
    files = run_shards(src, tmp_path, 2)
    r = nv("merge", tmp_path / "m.jsonl", *files)
    assert r.exit_code == 1 and "has the id 'k', which does not say its input line: give --input" in r.stderr
    assert not (tmp_path / "m.jsonl").exists()


def test_duplicates_are_refused_naming_the_id(tmp_path, engines):
    src = write_input(tmp_path)
    files = run_shards(src, tmp_path, 2)
    merged = tmp_path / "merged.jsonl"
    # a line written twice into its shard file
    good = files[0].read_text()
    files[0].write_text(good + good.splitlines(keepends=True)[2])
    r = nv("merge", merged, *files, "--input", src)
    assert r.exit_code == 1 and "duplicate id 5: " in r.stderr and "out.0.jsonl' line 3 answers already" in r.stderr
    # ... or copied into another shard's file
    files[0].write_text(good)
    files[1].write_text(files[1].read_text() + good.splitlines(keepends=True)[0])
    r = nv("merge", merged, *files, "-i", src)
    assert r.exit_code == 1 and "duplicate id 1:" in r.stderr and "out.0.jsonl' line 1 answers" in r.stderr
    assert not merged.exists()
    # an id that lines of two shards share: each shard answers it, an unsharded job would not
    shared = write_input(tmp_path, [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}], "shared.jsonl")
    files = run_shards(shared, tmp_path, 2)
    r = nv("merge", merged, *files, "--input", shared)
    assert r.exit_code == 1 and "duplicate id 'x': input lines 1 (shard 0) and 2 (shard 1) have it" in r.stderr
    # without --input: an explicit integer id that is another line's number
    clash = write_input(tmp_path, [{"id": 2, "prompt": "y" * 300}, {"prompt": "b"}], "clash.jsonl")
    files = run_shards(clash, tmp_path, 2)
    r = nv("merge", merged, *files)
    assert r.exit_code == 1 and "duplicate id 2:" in r.stderr, r.stderr


def test_shard_files_out_of_order_or_foreign_are_refused(tmp_path, engines):
    src = write_input(tmp_path)
    files = run_shards(src, tmp_path, 3)
    r = nv("merge", tmp_path / "m.jsonl", files[1], files[0], files[2], "--input", src)
    assert r.exit_code == 1 and "(id 'a'), which shard 1 owns: give the 3 shard files in shard-index order" in r.stderr
    other = write_input(tmp_path, [{"id": "zz", "prompt": "q"}], "other.jsonl")
    r = nv("merge", tmp_path / "m.jsonl", *files, "--input", other)
    assert r.exit_code == 1 and "which no line of --input has" in r.stderr
    files[2].write_text("not json\n" + files[2].read_text())
    r = nv("merge", tmp_path / "m.jsonl", *files, "--input", src)
    assert r.exit_code == 1 and "line 1 is not an nv output line" in r.stderr
    for args, words in (([files[0], files[0]], "is given twice"), ([tmp_path / "nope"], "does not exist"),
                        ([files[0], "--input", tmp_path / "nope"], "--input:")):
        r = nv("merge", tmp_path / "m.jsonl", *args)
        assert r.exit_code == 2 and words in r.stderr, r.stderr
    r = nv("merge", files[0], *files, "--input", src)
    assert r.exit_code == 2 and "is one of the files to merge" in r.stderr


@pytest.mark.parametrize("raw", [
    b'{"prompt": "x"}', b'{"id": "a", "prompt": "x"}', b'{"id": 7, "prompt": "x"}', b'{"id": null, "prompt": "x"}',
    b'{"custom_id": "c", "url": "/v1/completions", "body": {}}', b'{"id": null, "custom_id": "c", "prompt": "x"}',
    b'{"id": true, "prompt": "x"}', b'{"id": 1.5}', b'[1]', b'{oops', b'\xef\xbb\xbf{"prompt": "x"}', b'"s"',
])
def test_read_line_id_agrees_with_parse_line(raw):
    for line_no in (0, 4):
        assert read_line_id(raw, line_no) == parse_line(raw, line_no, Defaults()).id


def test_many_missing_lines_are_counted_after_the_first_few(tmp_path, engines):
    src = write_input(tmp_path, [{"prompt": f"p{i}"} for i in range(20)])
    files = run_shards(src, tmp_path, 2)
    files[1].write_text("")  # shard 1 was never served
    r = nv("merge", tmp_path / "m.jsonl", *files, "--input", src)
    assert r.exit_code == 1 and "10 of 20 input lines have no output line" in r.stderr
    assert "lacks 10: id 2, id 4, id 6, id 8, id 10 and 5 more\n" in r.stderr
    assert "shard 0" not in r.stderr and "--shard-index 1 --resume" in r.stderr
