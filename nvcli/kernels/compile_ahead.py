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

Once a start-up has compiled its variants, every later start-up with the same kernels, model and
settings finds them in Triton's disk cache, and loading them one by one takes 0.5 s; the dry pass
would only add a second or two. `StartupMarker` remembers, in Triton's cache directory, which
start-ups have compiled ahead (a key over everything that decides the variants), so those skip it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import xxhash
from triton.runtime.jit import JITFunction

KERNELS_DIR = Path(__file__).parent


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


def compile_ahead(run: Callable[[], object], device: torch.device, max_workers: int | None = None) -> tuple[int, float]:
    """Run `run` with uncompiled launches skipped, then compile what it would have launched, in parallel.
    Returns the number of variants compiled and the seconds the dry pass took."""
    t0 = time.perf_counter()
    with skipping_uncompiled_launches() as variants:
        run()
    torch.cuda.synchronize(device)
    dry_s = time.perf_counter() - t0
    compile_variants(variants, device, max_workers)
    return len(variants), dry_s


class StartupMarker:
    """A file in Triton's cache directory saying a start-up with this key has compiled its variants there.

    The key hashes `settings` (the model config, the engine config, the rank: whatever shapes the
    launches), `gpu` (its name and compute capability), the torch and Triton versions and the source of every kernel module, so any
    change makes a new key. A stale or missing marker costs time only: a variant that is not cached
    compiles at its first launch, as without compile-ahead."""

    def __init__(self, settings: object, gpu: str) -> None:
        h = xxhash.xxh64()
        h.update(json.dumps([settings, gpu, torch.__version__, triton.__version__], sort_keys=True,
                            default=str).encode())
        for path in sorted(KERNELS_DIR.glob("*.py")):
            h.update(path.read_bytes())
        self.path = Path(triton.knobs.cache.dir) / f"nv-startup-{h.hexdigest()}.done"

    def exists(self) -> bool:
        return self.path.exists()

    def write(self, num_variants: int) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(f"{num_variants} Triton variants compiled ahead\n")
        except OSError:  # a read-only cache: the next start-up compiles ahead again, nothing worse
            pass
