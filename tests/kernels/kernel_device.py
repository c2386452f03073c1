"""Run the kernel tests on the GPU when there is one, else on CPU tensors via the Triton interpreter.

Inputs and references are built on the CPU; `on_device` wraps a kernel entry point so its
tensor and PagedKV arguments travel to DEVICE, in-place results (the KV caches) come back, and so does
the return value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from nvcli.kernels.kv_layout import PagedKV

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple):
        return tuple(_to_cpu(v) for v in x)
    return x


def _to_device(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)  # keeps a dims-major view's strides (dense storage)
    if isinstance(x, PagedKV):
        return PagedKV(x.k.to(DEVICE), x.v.to(DEVICE), _to_device(x.k_scale), _to_device(x.v_scale))
    if isinstance(x, list):  # tensors standing in for peers' buffers
        return [_to_device(v) for v in x]
    return x


def _copy_back(a: Any, moved: Any) -> None:
    """Caches and outputs passed in (an amax buffer) are written in place: their device copies' values go back into
    the CPU originals."""
    if isinstance(a, torch.Tensor):
        a.copy_(moved.cpu())
    elif isinstance(a, list):
        for v, m in zip(a, moved):
            _copy_back(v, m)
    elif isinstance(a, PagedKV):
        a.k.copy_(moved.k.cpu())
        a.v.copy_(moved.v.cpu())


def on_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if DEVICE.type == "cpu":
            return fn(*args, **kwargs)
        moved = [_to_device(a) for a in args]
        moved_kw = {k: _to_device(v) for k, v in kwargs.items()}
        out = fn(*moved, **moved_kw)
        for a, m in zip(args, moved):
            _copy_back(a, m)
        for k, v in kwargs.items():
            _copy_back(v, moved_kw[k])
        return _to_cpu(out)

    return call


def linear_inputs(m: int, n: int, k: int, seed: int, dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [m, k], weight [n, k] scaled by k ** -0.5, bias [n]) on the CPU, for the GEMM tests."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, b
