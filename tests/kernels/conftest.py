"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, so it must be set before
the kernel modules are imported; if another test module imported them first (compiled
mode, unusable without a GPU), they are reloaded here.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import sys  # noqa: E402

_KERNEL_MODULES = (
    "nvcli.kernels.kv_store",
    "nvcli.kernels.decode_attention",
    "nvcli.kernels.prefill_attention",
    "nvcli.kernels.rms_norm",
)

if os.environ.get("TRITON_INTERPRET") == "1":
    for _name in _KERNEL_MODULES:
        _mod = sys.modules.get(_name)
        if _mod is not None:
            importlib.reload(_mod)
