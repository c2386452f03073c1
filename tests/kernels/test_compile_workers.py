"""Compile workers (nvcli/kernels/compile_ahead.py): the processes start without a GPU, and where a process
may not have children (a daemonic tensor-parallel rank) compile-ahead falls back to threads instead of
failing the start-up."""

from __future__ import annotations

import multiprocessing
import os

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
