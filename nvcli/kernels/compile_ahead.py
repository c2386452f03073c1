"""Compile the Triton kernel variants a start-up needs side by side, before the start-up runs them.

On a cold Triton cache the engine's start-up (profile run, CUDA-graph capture, kernel warm-up) first
launches about 30 kernel variants, and each launch waits for its compile and its launcher's C build:
16-20 s one after another on an H100 host. `compile_ahead(run)` calls `run` (those same forwards)
once with every launch of a variant that is not compiled yet skipped and recorded (Triton's
`jit_cache_hook`: a hook that returns True makes the JIT skip the compile and the launch); each
recorded variant compiles at once, launchers included, while the dry pass goes on, into Triton's
disk cache; then every variant is loaded into its kernel from there, and the start-up that follows
finds them all in memory. A skipped launch leaves its outputs unwritten, so `run` must not act on
kernel outputs (no sampling, no host reads); torch ops on garbage values are harmless.

The compiles run in `CompileWorkers`: processes forked from a server that has imported torch, Triton
and our kernels once. A compile holds the GIL for much of its time (Triton's Python front end and
pass pipeline), so 16 threads of one process gave only 2-3x over compiling one after another, and
they slowed the dry pass beside them. Without workers (they could not start) the compiles run on
threads of this process instead.

Once a start-up has compiled its variants, every later start-up with the same kernels, model and
settings finds them in Triton's disk cache, and loading them one by one takes 0.5 s; the dry pass
would only add a second or two. `StartupMarker` remembers, in Triton's cache directory, which
start-ups have compiled ahead (a key over everything that decides the variants), so those skip it.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
import xxhash
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from nvcli.child_processes import exit_with_parent

KERNELS_DIR = Path(__file__).parent
log = logging.getLogger("nvcli")


def variant_difference(fn: JITFunction, key: str) -> str:
    """How a kernel variant first met mid-run differs from the nearest one the process had already: the arguments
    whose specialization (type, alignment / divisibility, constexpr value) differ, nearest -> new."""
    for _, key_cache, *_ in fn.device_caches.values():
        specs = {cache_key: spec for (spec, _), cache_key in key_cache.items()}
        if key not in specs:
            continue
        new = specs[key]
        others = [spec for k, spec in specs.items() if k != key and len(spec) == len(new)]
        if not others:
            return "the kernel's first variant"
        near = min(others, key=lambda spec: sum(a != b for a, b in zip(spec, new)))
        names = [p.name for p in fn.params]
        return ", ".join(f"{names[i] if i < len(names) else i}: {a} -> {b}"
                         for i, (a, b) in enumerate(zip(near, new)) if a != b)
    return "specialization not found"


@dataclass(frozen=True)
class KernelVariant:
    """One specialization of a kernel, as the JIT serializes it (`JITFunction.preload` takes it back)."""

    kernel: JITFunction
    specialization: str  # JSON: signature, constexprs, attributes, options, cache key


@contextmanager
def skipping_uncompiled_launches(
    on_record: Callable[[KernelVariant], None] | None = None,
) -> Iterator[list[KernelVariant]]:
    """Within: launching a kernel variant that is not compiled yet records it (and passes it to
    `on_record`) and does nothing else: its outputs are not written. Variants already compiled launch
    as usual, and so do `preload`s (other threads compiling). Yields the recorded list."""
    recorded: list[KernelVariant] = []
    seen: set[tuple[int, str]] = set()
    previous = triton.knobs.runtime.jit_cache_hook

    def hook(*, key: str, repr: str, fn, compile: dict, is_manual_warmup: bool, already_compiled: bool) -> bool:
        if is_manual_warmup:  # a preload, not a launch
            return bool(previous and previous(key=key, repr=repr, fn=fn, compile=compile,
                                              is_manual_warmup=is_manual_warmup, already_compiled=already_compiled))
        if (id(fn.jit_function), key) not in seen:
            seen.add((id(fn.jit_function), key))
            variant = KernelVariant(fn.jit_function, compile["specialization_data"])
            recorded.append(variant)
            if on_record is not None:
                on_record(variant)
        return True

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield recorded
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


def _twin(kernel: JITFunction) -> JITFunction:
    """The same kernel with its own in-memory cache: compiling a variant through it fills Triton's disk
    cache (the key hashes the source and the options, not the object) but leaves `kernel` as it is, so
    no launch can find a variant whose launcher another thread is still loading."""
    return JITFunction(kernel.fn, version=kernel.version, do_not_specialize=kernel.do_not_specialize,
                       do_not_specialize_on_alignment=kernel.do_not_specialize_on_alignment, debug=kernel.debug,
                       noinline=kernel.noinline, repr=kernel._repr, launch_metadata=kernel.launch_metadata)


def _build(variant: KernelVariant, kernel: JITFunction) -> tuple[float, float]:
    started = time.time()
    compiled = kernel.preload(variant.specialization)
    compiled._init_handles()  # the launcher's C build (cached on disk too) and the module load
    return started, time.time()


def compile_variants(variants: list[KernelVariant], device: torch.device, max_workers: int | None = None) -> None:
    """Compile each variant into its kernel's in-memory cache (and Triton's disk cache), build its
    launcher and load it on `device`, `max_workers` at a time (default: one per CPU core, at most 16; 0: one after
    another in this thread)."""
    if not variants:
        return
    if max_workers == 0:  # in this thread (profiling)
        for v in variants:
            _build(v, v.kernel)
        return
    with _pool(device, max_workers) as pool:
        for future in [pool.submit(_build, v, v.kernel) for v in variants]:
            future.result()  # a compile error surfaces here, as it would at the launch


def _pool(device: torch.device, max_workers: int | None) -> ThreadPoolExecutor:
    workers = max_workers or min(16, os.cpu_count() or 1)
    return ThreadPoolExecutor(workers, initializer=torch.cuda.set_device, initargs=(device,))


def _compile_into_cache(module: str, name: str, specialization: str, target: tuple[str, int, int],
                        cache_dir: str) -> tuple[float, float]:
    """In a worker process: compile one variant of the kernel `module.name` and build its launcher, both
    into Triton's disk cache at `cache_dir`. What `JITFunction.preload` does, without a GPU: the target
    comes from the parent, and nothing is loaded onto a device (no CUDA context per worker). Returns the
    wall-clock start and end (time.time(), comparable across processes)."""
    started = time.time()
    from triton.compiler import ASTSource
    from triton.runtime.jit import convert_to_tuple_if_list

    triton.knobs.cache.dir = cache_dir
    kernel = getattr(importlib.import_module(module), name)
    data = json.loads(specialization)
    constexprs = {
        tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value)
        else tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
        for key, value in zip(data["constant_keys"], data["constant_vals"])
    }
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {key: convert_to_tuple_if_list(value) for key, value in data["signature"].items()}
    options = {key: tuple(value) if isinstance(value, list) else value for key, value in data["options"].items()}
    _compile_with_launcher(ASTSource(kernel, signature, constexprs, attrs), options, target)
    return started, time.time()


def _compile_with_launcher(src: object, options: dict, target: tuple[str, int, int]) -> None:
    """Compile `src` (a Triton ASTSource) for `target` into Triton's disk cache, and build its launcher (the C build,
    cached by its source), without loading anything onto a device."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    gpu_target = GPUTarget(*target)
    compiled = triton.compile(src, target=gpu_target, options=make_backend(gpu_target).parse_options(options).__dict__)
    driver.active.launcher_cls(compiled.src, compiled.metadata)


def _worker_ready() -> int:
    return os.getpid()


@triton.jit
def _warm_up_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


KERNEL_MODULES = sorted(p.stem for p in KERNELS_DIR.glob("*.py") if p.stem not in ("__init__", "compile_ahead"))


def _warm_worker(target: tuple[str, int, int] | None, cache_dir: str) -> None:
    """A worker's first compile pays one-time costs (1.3-1.5 s on the H100 host): importing
    our kernel modules and Triton's compiler, the backend's first pass pipeline, the driver's C helpers on a cold
    cache. Each worker pays them here, as it starts, which the engine arranges to be while it loads the tokenizer:
    a trivial kernel compiled for the parent's GPU, launcher included. A failure here only leaves them to the
    first real compile."""
    exit_with_parent()  # a start-up killed outright takes its compile workers with it
    if target is None:
        return
    try:
        from triton.compiler import ASTSource

        triton.knobs.cache.dir = cache_dir
        for name in KERNEL_MODULES:
            importlib.import_module(f"{__package__}.{name}")
        _compile_with_launcher(ASTSource(_warm_up_kernel, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                                         {(2,): 128}), {"num_warps": 1}, target)
    except Exception as e:  # noqa: BLE001
        log.debug("compile worker warm-up failed: %s: %s", type(e).__name__, e)


class CompileWorkers:
    """Processes that compile kernel variants into Triton's disk cache (see the module docstring).

    Start them early (the engine does before loading weights). The fork server first imports torch
    and Triton (about 2.5 s), and starting a worker waits for it, so the pool is built on a thread:
    this process goes on at once, and variants submitted before the pool is up are queued for it. A
    worker needs no GPU and holds no CUDA context."""

    def __init__(self, max_workers: int | None = None, target: tuple[str, int, int] | None = None) -> None:
        """`target`: (backend, arch, warp size) of the GPU the variants are for; each worker then warms up for it
        as it starts (`_warm_worker`)."""
        self.num_workers = max_workers or min(16, os.cpu_count() or 1)
        self.target = target
        self.pool: ProcessPoolExecutor | None = None
        self._error: BaseException | None = None
        self._queued: list[tuple[Future, tuple]] = []
        self._lock = threading.Lock()
        self._starter = threading.Thread(target=self._start, name="nv-compile-workers", daemon=True)
        self._starter.start()

    def _start(self) -> None:
        pool, error = None, None
        try:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__])  # not __main__: a script's top level stays unrun
            pool = ProcessPoolExecutor(self.num_workers, mp_context=context, initializer=_warm_worker,
                                       initargs=(self.target, triton.knobs.cache.dir))
            for _ in range(self.num_workers):  # one process per submit: start them all now
                pool.submit(_worker_ready)
        except BaseException as e:  # noqa: BLE001 - surfaces through every queued and later submit
            error = e
        with self._lock:
            self.pool, self._error = pool, error
            queued, self._queued = self._queued, []
        for future, args in queued:
            _forward(self._run(args), future)

    def _run(self, args: tuple) -> Future:
        if self.pool is None:
            failed: Future = Future()
            failed.set_exception(RuntimeError(f"compile workers did not start: {self._error!r}"))
            return failed
        return self.pool.submit(_compile_into_cache, *args)

    def submit(self, variant: KernelVariant, target: tuple[str, int, int]) -> Future:
        fn = variant.kernel.fn
        args = (fn.__module__, fn.__name__, variant.specialization, target, triton.knobs.cache.dir)
        with self._lock:
            if self._starter.is_alive() and self.pool is None and self._error is None:
                future: Future = Future()
                self._queued.append((future, args))
                return future
        return self._run(args)

    def wait_started(self) -> bool:
        """Block until the pool is built; whether it is up."""
        self._starter.join()
        return self.pool is not None

    def shutdown(self) -> None:
        if self.wait_started():
            self.pool.shutdown(wait=False, cancel_futures=True)


def _forward(source: Future, target: Future) -> None:
    """Complete `target` with `source`'s outcome once it has one."""
    def done(f: Future) -> None:
        if f.exception() is not None:
            target.set_exception(f.exception())
        else:
            target.set_result(f.result())

    source.add_done_callback(done)


def start_compile_workers(max_workers: int | None = None, target: tuple[str, int, int] | None = None
                          ) -> CompileWorkers | None:
    """CompileWorkers, or None where this process may not start them (compile-ahead then uses threads): a
    daemonic process, such as a tensor-parallel worker rank, may have no children."""
    if multiprocessing.current_process().daemon:
        return None
    return CompileWorkers(max_workers, target)


def compile_ahead(run: Callable[[], object], device: torch.device, max_workers: int | None = None,
                  workers: CompileWorkers | None = None) -> tuple[int, float]:
    """Run `run` with uncompiled launches skipped; every variant it would have launched compiles as soon
    as it is recorded, into Triton's disk cache, so the compiles overlap the dry pass: in `workers` when
    given, else in a thread pool (on a twin of its kernel). Then each variant is loaded into its own
    kernel from that cache, in parallel; one a worker failed on compiles there, as it would have at its
    launch. Returns the number of variants and the seconds the dry pass took."""
    twins: dict[int, JITFunction] = {}
    target = driver.active.get_current_target()
    target_args = (target.backend, target.arch, target.warp_size)
    with _pool(device, max_workers) as pool:
        futures: list[tuple[KernelVariant, float, Future]] = []

        def on_record(v: KernelVariant) -> None:
            if workers is not None:
                futures.append((v, time.time(), workers.submit(v, target_args)))
            else:
                twin = twins.setdefault(id(v.kernel), _twin(v.kernel))
                futures.append((v, time.time(), pool.submit(_build, v, twin)))

        t0, wall0 = time.perf_counter(), time.time()
        with skipping_uncompiled_launches(on_record) as variants:
            run()
        torch.cuda.synchronize(device)
        dry_s = time.perf_counter() - t0
        timeline = []
        for variant, submitted, future in futures:
            try:
                span = future.result()
            except Exception as e:  # noqa: BLE001 - the load below compiles it, or raises the real error
                if workers is None:
                    raise
                log.warning("compile worker failed on %s (%s: %s); compiling it here",
                            variant.kernel.fn.__name__, type(e).__name__, e)
            else:
                timeline.append((variant.kernel.fn.__name__, submitted - wall0, *(t - wall0 for t in span)))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("compile-ahead, s after the dry pass began (it took %.1f s): %s", dry_s, compile_timeline(timeline))
    t1 = time.perf_counter()
    compile_variants(variants, device, max_workers)  # from disk now
    log.debug("compile-ahead: %d variants loaded in %.2f s (%.2f s after the dry pass began)", len(variants),
              time.perf_counter() - t1, time.perf_counter() - t0)
    return len(variants), dry_s


def compile_timeline(timeline: list[tuple[str, float, float, float]]) -> str:
    """(kernel, submitted, started, finished) per variant, in seconds after the dry pass began: one line each,
    latest finish first, so the start-up's critical path leads."""
    rows = sorted(timeline, key=lambda r: -r[3])
    return "".join(f"\n  {name}: submitted {sub:.2f}, started {start:.2f}, finished {end:.2f} ({end - start:.2f} s)"
                   for name, sub, start, end in rows)


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
            # data-parallel replicas start at once and share the cache: each writes its own file, then renames
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(f"{num_variants} Triton variants compiled ahead\n")
            os.replace(tmp, self.path)
        except OSError:  # a read-only cache: the next start-up compiles ahead again, nothing worse
            pass
