"""benchmarks/ab.py without a GPU: its row parsing, and whole A/B runs over fake trees whose scripts print rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

AB_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "ab.py"


@pytest.fixture(scope="module")
def ab() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ab_harness", AB_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ab_harness"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


GPU_E2E_OUTPUT = """\
## device: NVIDIA H100 80GB HBM3
## start-up (bf16, dummy qwen3-0.6b, graphs captured): 9.3 s, 39631 KV blocks
## host/device split (bf16, all runs): steps 3072 (decode-only 3045), schedule 1.00 s, execute+sample 18.2 s
## throughput bf16 KV (median of 3): 20,391 output tok/s, 6.57 s, runs [6.6, 6.57, 6.5], 80.0% of floor
## sampling: 64 prompts x n=4: 29,040 output tok/s, runs [4.58, 4.6], prompt tokens computed per run 36,096
## latency 128+512, one request, Qwen3's sampling (temperature 0.6, top_k 20, top_p 0.95): 0.823 ms/token, TTFT 2.6 ms
## fp8: FAILED (traceback above)
## imports 3.1 s (torch, triton, nvcli; transformers loads lazily)
## start-up to first token (auto KV, 51 decode graphs, 34 mixed graphs): 5.0 s (engine ready 4.1 s)

| what | result |
| --- | --- |
| throughput bf16 KV (median of 3) | 20,391 output tok/s |
"""


def test_hash_rows_give_name_value_and_unit(ab: ModuleType) -> None:
    rows, failed = ab.parse_rows(GPU_E2E_OUTPUT)
    assert [(r.name, r.value, r.unit) for r in rows] == [
        ("start-up", 9.3, "s"),
        ("throughput bf16 KV", 20391.0, "output tok/s"),
        ("sampling: 64 prompts x n=4", 29040.0, "output tok/s"),
        ("latency 128+512, one request, Qwen3's sampling", 0.823, "ms/token"),
        ("imports", 3.1, "s"),
        ("start-up to first token", 5.0, "s"),
    ]
    assert failed == ["fp8"]


def test_without_hash_rows_the_last_table_is_read(ab: ModuleType) -> None:
    text = """\
| stream | early | 1 output tok/s | printed while running |
| what | case | time | |
| --- | --- | --- | --- |
| stream | shared-prefix kernel: decode and mixed steps | 42,700 output tok/s (6.20 s) | steps 803 |
| stream | own prompts of the same length | 16,100 output tok/s (16.4 s) | steps 900 |

whole jobs
| input | s | prompt tok/s | vs engine |
| --- | --- | --- | --- |
| engine | 2.41 | 318,000 | 1.00x |
| echo | 3.27 | 235,000 | 0.74x |
"""
    rows, failed = ab.parse_rows(text)
    assert [(r.name, r.value, r.unit) for r in rows] == [("engine", 2.41, "s"), ("echo", 3.27, "s")]
    assert failed == []
    rows, _ = ab.parse_rows(text.split("\nwhole jobs")[0])
    assert [(r.name, r.value, r.unit) for r in rows] == [
        ("stream: shared-prefix kernel: decode and mixed steps", 42700.0, "output tok/s"),
        ("stream: own prompts of the same length", 16100.0, "output tok/s"),
    ]


FAKE_SCRIPT = """\
import os
import sys
from pathlib import Path

import fakepkg  # from the tree on PYTHONPATH

count = Path("runs.txt")  # in the tree: the run's working directory
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
if fakepkg.FAIL:
    print("something broke")
    sys.exit(3)
print("## device: fake")
print(f"## speed (median of 3): {fakepkg.SPEED + n:,} output tok/s, runs [1.0]")
print("cache=" + os.environ.get("TRITON_CACHE_DIR", ""))
"""


def cache_of(run: Any) -> str:
    """The TRITON_CACHE_DIR a fake run (an ab.Run) saw."""
    lines = Path(run.log).read_text().splitlines()
    return next(line.removeprefix("cache=") for line in lines if line.startswith("cache="))


def make_tree(root: Path, speed: int, fail: bool = False) -> Path:
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "fake.py").write_text(FAKE_SCRIPT)
    (root / "fakepkg").mkdir()
    (root / "fakepkg" / "__init__.py").write_text(f"SPEED = {speed}\nFAIL = {fail}\n")
    return root


def test_two_trees_each_run_their_own_script_and_package(ab: ModuleType, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", "outer")
    base, new = make_tree(tmp_path / "base", 1000), make_tree(tmp_path / "new", 1100)
    logs = tmp_path / "logs"
    logs.mkdir()
    cases = {"fake": ab.Case("benchmarks/fake.py", ("--ignored",), cold_triton_cache=True)}
    runs, summary = ab.run_ab(base, new, cases, rounds=2, logs=logs, timeout_s=60)
    assert [(r.tree, r.round, r.rc) for r in runs] == [("base", 1, 0), ("new", 1, 0), ("base", 2, 0), ("new", 2, 0)]
    speed = next(e for e in summary if e["row"] == "speed")
    assert speed["base"] == [1000, 1001] and speed["new"] == [1100, 1101]  # each tree's runs counted in its own cwd
    assert speed["base_median"] == 1000.5 and speed["new_median"] == 1100.5
    assert speed["ratio"] == pytest.approx(1100.5 / 1000.5)
    caches = [cache_of(r) for r in runs]  # a cold case: an empty cache per run
    assert len(set(caches)) == 4 and "outer" not in caches
    table = ab.format_table(summary)
    assert "| fake | speed | 1,000 output tok/s | 1,100 output tok/s | 1.100 |" in table
    assert "[round 2/2] fake new: exit 0" in capsys.readouterr().out


def test_a_failing_tree_prints_its_exit_code_and_log_and_the_rest_goes_on(ab: ModuleType, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]
                                                                         ) -> None:
    base, new = make_tree(tmp_path / "base", 1000), make_tree(tmp_path / "new", 1100, fail=True)
    cases = {"fake": ab.Case("benchmarks/fake.py"), "missing": ab.Case("benchmarks/nowhere.py")}
    logs = tmp_path / "logs"
    logs.mkdir()
    runs, summary = ab.run_ab(base, new, cases, rounds=1, logs=logs, timeout_s=60)
    assert [(r.case, r.tree, r.rc) for r in runs] == [("fake", "base", 0), ("fake", "new", 3),
                                                      ("missing", "base", -1), ("missing", "new", -1)]
    printed = capsys.readouterr().out
    assert "fake new exit code 3" in printed and "something broke" in printed
    speed = next(e for e in summary if e["row"] == "speed")
    assert speed["new"] == [] and speed["new_median"] is None and speed["ratio"] is None
    assert "| fake | speed | 1,000 output tok/s | - | - |" in ab.format_table(summary)


def test_main_writes_json_and_exits_nonzero_on_a_failed_run(ab: ModuleType, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    base, new = make_tree(tmp_path / "base", 1000), make_tree(tmp_path / "new", 1100, fail=True)
    monkeypatch.setitem(ab.CASES, "fake", ab.Case("benchmarks/fake.py"))
    out = tmp_path / "ab.json"
    rc = ab.main(["--base", str(base), "--new", str(new), "--cases", "fake", "--rounds", "1",
                  "--logs", str(tmp_path / "logs"), "--out", str(out)])
    assert rc == 1
    data = json.loads(out.read_text())
    assert [(r["tree"], r["rc"]) for r in data["runs"]] == [("base", 0), ("new", 3)]
    assert data["summary"][0]["base"] == [1000]
    with pytest.raises(SystemExit):
        ab.main(["--base", str(base), "--cases", "no-such-case"])


def test_each_tree_keeps_its_own_triton_cache_across_rounds(ab: ModuleType, tmp_path: Path) -> None:
    base, new = make_tree(tmp_path / "base", 1000), make_tree(tmp_path / "new", 1100)
    logs = tmp_path / "logs"
    logs.mkdir()
    runs, _ = ab.run_ab(base, new, {"fake": ab.Case("benchmarks/fake.py")}, rounds=2, logs=logs, timeout_s=60)
    caches = {(r.tree, r.round): cache_of(r) for r in runs}
    assert caches["base", 1] == caches["base", 2] != caches["new", 1] == caches["new", 2]
    assert not Path(caches["base", 1]).parent.exists()  # removed with the harness's temp folder
