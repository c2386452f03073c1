"""Kernel tests: on the GPU when there is one, else CPU tensors through the Triton interpreter.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, so it must be set before
the kernel modules are imported; if another test module imported them first (compiled
mode, unusable without a GPU), they are reloaded here.
"""

from __future__ import annotations

import importlib
import os
import sys

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
