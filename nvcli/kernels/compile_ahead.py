"""Compile the Triton kernel variants a start-up needs side by side, before the start-up runs them.

On a cold Triton cache the engine's start-up (profile run, CUDA-graph capture, kernel warm-up) first
launches about 30 kernel variants, and each launch waits for its compile and its launcher's C build:
16 s one after another on an H100 host. `compile_ahead(run)` calls `run` (those same forwards) once
with every launch of a variant that is not compiled yet skipped and recorded (Triton's
`jit_cache_hook`: a hook that returns True makes the JIT skip the compile and the launch), then
compiles the recorded variants and loads them, launchers included, in a thread pool: the MLIR
passes, LLVM and ptxas run outside the GIL. The start-up that follows finds every variant in
memory. A skipped launch leaves its outputs unwritten, so `run` must not act on kernel outputs (no
sampling, no host reads); torch ops on garbage values are harmless.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class KernelVariant:
    """One specialization of a kernel, as the JIT serializes it (`JITFunction.preload` takes it back)."""

    kernel: JITFunction
    specialization: str  # JSON: signature, constexprs, attributes, options, cache key


@contextmanager
def skipping_uncompiled_launches() -> Iterator[list[KernelVariant]]:
    """Within: launching a kernel variant that is not compiled yet records it and does nothing else (its
    outputs are not written). Variants already compiled launch as usual. Yields the recorded list."""
    recorded: list[KernelVariant] = []
    seen: set[tuple[int, str]] = set()
    previous = triton.knobs.runtime.jit_cache_hook

    def hook(*, key: str, repr: str, fn, compile: dict, is_manual_warmup: bool, already_compiled: bool) -> bool:
        if (id(fn.jit_function), key) not in seen:
            seen.add((id(fn.jit_function), key))
            recorded.append(KernelVariant(fn.jit_function, compile["specialization_data"]))
        return True

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield recorded
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


def compile_variants(variants: list[KernelVariant], device: torch.device, max_workers: int | None = None) -> None:
    """Compile each variant into its kernel's in-memory cache (and Triton's disk cache), build its
    launcher and load it on `device`, `max_workers` at a time (default: one per CPU core, at most 16)."""
    if not variants:
        return
    workers = max_workers or min(16, os.cpu_count() or 1)

    def build(variant: KernelVariant) -> None:
        kernel = variant.kernel.preload(variant.specialization)
        kernel._init_handles()  # the launcher's C build and the module load; a launch would do both

    with ThreadPoolExecutor(workers, initializer=torch.cuda.set_device, initargs=(device,)) as pool:
        for future in [pool.submit(build, v) for v in variants]:
            future.result()  # a compile error surfaces here, as it would at the launch


def compile_ahead(run: Callable[[], object], device: torch.device, max_workers: int | None = None) -> int:
    """Run `run` with uncompiled launches skipped, then compile what it would have launched, in parallel.
    Returns the number of variants compiled."""
    with skipping_uncompiled_launches() as variants:
        run()
    torch.cuda.synchronize(device)
    compile_variants(variants, device, max_workers)
    return len(variants)
