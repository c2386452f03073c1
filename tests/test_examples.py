"""Every file in examples/ runs cleanly with the default model (SmolLM2-135M-Instruct, on CPU): each JSONL file
through `nv generate`'s own code path, every line answered without an error; each script as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nvcli.config import EngineConfig
from nvcli.jobs import command
from nvcli.jobs.command import GenerateArgs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").iterdir())
MAX_TOKENS = 2  # the lines' own budgets, cut: the check is that they are served, not what they say


class _Shared:
    """The module's one engine, kept open across jobs (a job shuts its engine down when it ends)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine():
    from nvcli.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=1024, max_num_seqs=8, num_kvcache_blocks=128))
    yield _Shared(engine)
    engine.shutdown()


def test_examples_are_jsonl_files_or_scripts():
    assert EXAMPLES and all(p.suffix in (".jsonl", ".py") for p in EXAMPLES), [p.name for p in EXAMPLES]


def _capped(src: Path, dst: Path) -> int:
    lines = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    for obj in lines:
        for d in (obj, obj.get("body", {})):
            for k in ("max_tokens", "max_completion_tokens"):
                if k in d:
                    d[k] = min(d[k], MAX_TOKENS)
    dst.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    return len(lines)


@pytest.mark.parametrize("example", [p for p in EXAMPLES if p.suffix == ".jsonl"], ids=lambda p: p.name)
def test_jsonl_example_runs_with_the_default_model(example: Path, engine, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(command, "make_engine", lambda config: engine)
    src, out = tmp_path / example.name, tmp_path / "out.jsonl"
    n = _capped(example, src)
    rc = command.generate(GenerateArgs(input=str(src), output=str(out), engine={"device": "cpu"},
                                       sampling={"max_tokens": MAX_TOKENS}, quiet=True))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert rc == 0, capsys.readouterr().err
    assert len(lines) == n
    for line in lines:
        assert line.get("error") is None, line
        assert "response" not in line or line["response"]["status_code"] == 200, line


@pytest.mark.parametrize("example", [p for p in EXAMPLES if p.suffix == ".py"], ids=lambda p: p.name)
def test_script_example_runs(example: Path):
    r = subprocess.run([sys.executable, str(example)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
