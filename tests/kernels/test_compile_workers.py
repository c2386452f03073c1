"""Compile workers (nvcli/kernels/compile_ahead.py): the processes start without a GPU, and where a process
may not have children (a daemonic tensor-parallel rank) compile-ahead falls back to threads instead of
failing the start-up."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from nvcli.kernels.compile_ahead import CompileWorkers, _worker_ready, start_compile_workers


def test_workers_are_separate_processes() -> None:
    workers = CompileWorkers(2)
    try:
        assert workers.wait_started()
        pids = {workers.pool.submit(_worker_ready).result(timeout=120) for _ in range(4)}
    finally:
        workers.shutdown()
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def _start_in_daemon(result: multiprocessing.Queue) -> None:
    workers = start_compile_workers(2)
    result.put(workers is None)
    if workers is not None:
        workers.shutdown()


def test_daemonic_process_falls_back_to_threads() -> None:
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    proc = ctx.Process(target=_start_in_daemon, args=(result,), daemon=True)
    proc.start()
    try:
        assert result.get(timeout=120) is True, "start_compile_workers must return None, not raise"
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0


WARM_UP_SCRIPT = """
import sys
from pathlib import Path

from nvcli.kernels.compile_ahead import CompileWorkers, _worker_ready

if __name__ == "__main__":
    target = ("cuda", 90, 32) if sys.argv[1] == "sm90" else None
    workers = CompileWorkers(1, target)
    try:
        assert workers.wait_started()
        workers.pool.submit(_worker_ready).result(timeout=180)
    finally:
        workers.shutdown()
"""


def test_workers_warm_up_for_the_gpu_as_they_start(tmp_path) -> None:
    """Given the GPU target, each worker pays its first compile's one-time costs as it starts, before any variant
    is submitted: a trivial kernel compiled for that GPU lands in Triton's cache (for sm_90, on any machine; the
    launcher's C build needs a CUDA driver, so only the compile is checked). Without a target, nothing compiles.
    In a fresh process without the interpreter: this session's forkserver runs with it."""
    script = tmp_path / "warm_up.py"
    script.write_text(WARM_UP_SCRIPT)
    for arg in ("sm90", "none"):
        cache = tmp_path / arg
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache)}
        proc = subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert bool(list(cache.glob("*/_warm_up_kernel.cubin"))) == (arg == "sm90")


KILLED_START_UP = """
import os, signal
from nvcli.kernels.compile_ahead import CompileWorkers, _worker_ready

if __name__ == "__main__":
    workers = CompileWorkers(2)
    assert workers.wait_started()
    print(*{workers.pool.submit(_worker_ready).result(timeout=180) for _ in range(4)}, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_end_with_a_start_up_that_is_killed(tmp_path) -> None:
    """A start-up killed outright while it compiles (SIGKILL, the OOM killer) takes its compile workers with it:
    each has torch and Triton loaded, and they waited on their queue forever."""
    from nvcli.testing.processes import workers_left_by_a_killed_job

    left, _ = workers_left_by_a_killed_job(KILLED_START_UP, tmp_path)
    assert left == []
