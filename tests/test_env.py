"""nvcli.env: the environment variables nv reads, checked once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvcli import env
from nvcli.config import ConfigError


def test_defaults() -> None:
    s = env.read({"HOME": os.path.expanduser("~")})
    assert s == env.Settings(cache_dir=Path.home() / ".cache" / "nv")
    assert not s.debug and s.debug_stacks_after_s is None and s.compile_workers is None


def test_cache_dir_precedence(tmp_path: Path) -> None:
    assert env.read({"NV_CACHE_DIR": str(tmp_path / "x"), "XDG_CACHE_HOME": "/xdg"}).cache_dir == tmp_path / "x"
    assert env.read({"NV_CACHE_DIR": "", "XDG_CACHE_HOME": str(tmp_path)}).cache_dir == tmp_path / "nv"
    assert env.read({"NV_CACHE_DIR": "~/nv-cache"}).cache_dir == Path.home() / "nv-cache"
    assert env.read({"XDG_CACHE_HOME": ""}).cache_dir == Path.home() / ".cache" / "nv"


def test_values_are_typed() -> None:
    s = env.read({"NV_DEBUG": "1", "NV_DEBUG_STACKS_AFTER_S": "2.5", "NV_COMPILE_WORKERS": " 4 "})
    assert s.debug is True and s.debug_stacks_after_s == 2.5 and s.compile_workers == 4
    assert env.read({"NV_DEBUG": "0"}).debug is False
    assert env.read({"NV_DEBUG": ""}).debug is False
    assert env.read({"NV_DEBUG": "True"}).debug is True


@pytest.mark.parametrize("name,value", [
    ("NV_DEBUG", "2"),
    ("NV_DEBUG", "maybe"),
    ("NV_DEBUG_STACKS_AFTER_S", "soon"),
    ("NV_DEBUG_STACKS_AFTER_S", "0"),
    ("NV_DEBUG_STACKS_AFTER_S", "-1"),
    ("NV_DEBUG_STACKS_AFTER_S", "inf"),
    ("NV_DEBUG_STACKS_AFTER_S", "nan"),
    ("NV_COMPILE_WORKERS", "0"),
    ("NV_COMPILE_WORKERS", "1.5"),
    ("NV_COMPILE_WORKERS", "many"),
])
def test_a_bad_value_names_its_variable(name: str, value: str) -> None:
    with pytest.raises(env.EnvError, match=f"^{name}={value!r}: use "):
        env.read({name: value})
    assert issubclass(env.EnvError, ConfigError)  # printed as a usage error, without a traceback


def test_read_once_until_reload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NV_CACHE_DIR", str(tmp_path / "a"))
    first = env.settings()
    assert first.cache_dir == tmp_path / "a"
    monkeypatch.setenv("NV_CACHE_DIR", str(tmp_path / "b"))
    assert env.settings() is first  # not read again
    assert env.reload().cache_dir == tmp_path / "b"
    assert env.settings().cache_dir == tmp_path / "b"


def test_a_bad_value_fails_the_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NV_DEBUG_STACKS_AFTER_S", "later")
    with pytest.raises(env.EnvError, match="NV_DEBUG_STACKS_AFTER_S"):
        env.reload()
