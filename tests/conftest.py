from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _environment_read_afresh():
    """nvcli.env reads the environment once per process: each test reads it again on first use, so a variable a
    fixture or an earlier test set (monkeypatch) counts exactly while it is set."""
    from nvcli import env

    env.settings.cache_clear()
    yield
    env.settings.cache_clear()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model_dir("qwen3"|"qwen2"|"llama") -> path of a random tiny checkpoint."""
    from nvcli.testing.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, Path] = {}

    def make(arch: str = "qwen3") -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(root / arch, arch)
        return cache[arch]

    return make
