"""The environment variables nv reads: the only module that reads them.

Every tuning decision lives in the code as its one path; what is left here are settings of the user's
machine and switches for diagnosing a failure:

- `NV_CACHE_DIR`: nv's cache root (GGUF files converted to safetensors go under `gguf/` in it). Unset or
  empty: `$XDG_CACHE_HOME/nv`, or `~/.cache/nv` where `XDG_CACHE_HOME` is unset or empty too. `~` expands.
- `NV_DEBUG`: `1` lets a job that stops on an engine error (a lost tensor-parallel worker, out of memory, a
  bug) end with the Python traceback instead of a one-line message. `0` or unset: the message.
- `NV_DEBUG_STACKS_AFTER_S`: seconds, a positive number: each tensor-parallel worker prints its threads'
  stacks to stderr that long after it starts (diagnosing a hang). Unset: never.
- `NV_COMPILE_WORKERS`: processes that compile Triton kernels ahead of a cold start-up on the GPU, a positive
  integer. Unset: one per CPU core of the rank's share of the cores, at most 16; fewer leave memory and cores
  to other work on a shared host (each worker imports torch and Triton).

They are read once, on first use (`settings()`), and checked together: a bad value of any of them fails
that first use with an `EnvError` naming the variable. `reload()` reads them again (tests that change them).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from nvcli.config import ConfigError, EngineConfig

CACHE_DIR = "NV_CACHE_DIR"
DEBUG = "NV_DEBUG"
DEBUG_STACKS_AFTER_S = "NV_DEBUG_STACKS_AFTER_S"
COMPILE_WORKERS = "NV_COMPILE_WORKERS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class EnvError(ConfigError):
    """An environment variable with a value nv cannot use; the message names it."""


@dataclass(frozen=True)
class Settings:
    cache_dir: Path  # NV_CACHE_DIR, else $XDG_CACHE_HOME/nv, else ~/.cache/nv
    debug: bool = False  # NV_DEBUG
    debug_stacks_after_s: float | None = None  # NV_DEBUG_STACKS_AFTER_S; None: never
    compile_workers: int | None = None  # NV_COMPILE_WORKERS; None: the engine's default


def _flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(f"{name}={environ[name]!r}: use 1 or 0")


def _positive(environ: Mapping[str, str], name: str, kind: type[int] | type[float], what: str) -> int | float | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = kind(value)
    except ValueError:
        number = math.nan
    if not (number > 0 and math.isfinite(number)):
        raise EnvError(f"{name}={environ[name]!r}: use {what} above 0, or leave it unset")
    return number


def _cache_dir(environ: Mapping[str, str]) -> Path:
    if environ.get(CACHE_DIR):
        return Path(environ[CACHE_DIR]).expanduser()
    xdg = environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "nv"


def read(environ: Mapping[str, str]) -> Settings:
    """The settings `environ` gives; EnvError names the first variable with a bad value."""
    return Settings(
        cache_dir=_cache_dir(environ),
        debug=_flag(environ, DEBUG),
        debug_stacks_after_s=_positive(environ, DEBUG_STACKS_AFTER_S, float, "a number of seconds"),
        compile_workers=_positive(environ, COMPILE_WORKERS, int, "a whole number"),
    )


@cache
def settings() -> Settings:
    """This process's settings, read from its environment on the first call."""
    return read(os.environ)


def reload() -> Settings:
    """Read the environment again (tests that set these variables)."""
    settings.cache_clear()
    return settings()


def report(config: EngineConfig) -> str:
    """`--debug`'s account of a run's settings: every engine setting (resolved against the model where the engine
    has done so) and nv's environment variables, one per line."""
    lines = ["engine settings:"]
    lines += [f"  {f.name} = {getattr(config, f.name)!r}" for f in dataclasses.fields(config)]
    lines.append("environment (nvcli/env.py):")
    lines += [f"  {f.name} = {getattr(settings(), f.name)!r}" for f in dataclasses.fields(Settings)]
    return "\n".join(lines)
