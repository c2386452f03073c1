"""The package's layout keeps its seams: no import cycle, models and kernels apart from the engine, files a newcomer
reads in one sitting, environment variables read in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "nvcli"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """Every nvcli module `path` imports: at module level, under TYPE_CHECKING and inside functions alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nvcli"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in mods else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("nvcli"))
    return {m for m in found if m in mods}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycle_and_models_and_kernels_never_import_the_engine() -> None:
    mods = _modules()
    graph = {name: _imports(path, mods) - {name} for name, path in mods.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    for name, deps in graph.items():
        if name.startswith(("nvcli.models", "nvcli.kernels", "nvcli.attention")):
            assert not {d for d in deps if d.startswith("nvcli.engine")}, name


def test_files_are_read_in_one_sitting() -> None:
    for path in ROOT.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if path.parent.name != "kernels":
            assert lines <= 500, f"{path.relative_to(ROOT.parent)}: {lines} lines"
    assert len((ROOT / "engine" / "model_runner.py").read_text().splitlines()) <= 400


def test_nv_environment_variables_are_read_in_one_module() -> None:
    readers = {path.relative_to(ROOT.parent).as_posix() for path in ROOT.rglob("*.py")
               if re.search(r"(environ|getenv)\b[^\n]*[\"']NV_", path.read_text())}
    assert readers <= {"nvcli/env.py"}, readers
