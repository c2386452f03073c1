"""Kernel tests: on the GPU when there is one, else CPU tensors through the Triton interpreter.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, so it must be set before
the kernel modules are imported; if another test module imported them first (compiled
mode, unusable without a GPU), they are reloaded here.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import version

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime.jit import JITFunction

    # pdl first: the other kernel modules import its jitted helpers, and must get the reloaded ones
    for _name in sorted((n for n in sys.modules if n.startswith("nvcli.kernels.")), key=lambda n: (n != "nvcli.kernels.pdl", n)):
        _mod = sys.modules[_name]
        if any(isinstance(v, JITFunction) for v in vars(_mod).values()):
            importlib.reload(_mod)  # decorated before the interpreter was switched on


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


# Triton's interpreter before 3.7 turns a loop's runtime bound into a Python int with int() of a one-element array,
# which numpy 2.4 refuses, so every kernel with such a loop fails there (3.7 squeezes the array first). Compiled
# kernels are unaffected; scripts/constraints-cpu.txt pins a numpy below 2.4 beside Triton 3.6.
_INTERPRETER_BROKEN = (os.environ.get("TRITON_INTERPRET") == "1" and _minor(version("triton")) < (3, 7)
                       and _minor(version("numpy")) >= (2, 4))


@pytest.fixture(autouse=True)
def _interpreter_can_run_the_kernels():
    if _INTERPRETER_BROKEN:
        pytest.skip(f"Triton {version('triton')}'s interpreter cannot run loops over a runtime bound with numpy "
                    f"{version('numpy')}: use numpy < 2.4 or Triton >= 3.7")
