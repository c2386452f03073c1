"""What each worker process that nv starts does first: end when the process that started it is gone.

A ProcessPoolExecutor's worker waits on its call queue, whose write end it holds itself, so it never reads an end of
file there: a job killed outright (SIGKILL, the OOM killer) left its format workers, its compile workers and
multiprocessing's resource tracker running forever, and the tracker holds the job's stdout, so a pipeline reading
that stdout never ended either. Tensor-parallel ranks (engine/tp_executor.py) call it too.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading


def exit_with_parent() -> None:
    """In a multiprocessing child (spawned, or forked from a forkserver): exit at once when the process that started
    it has ended (multiprocessing's parent sentinel, which works for forkserver children too)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    threading.Thread(target=_wait_and_exit, args=(parent.sentinel,), name="nv-parent-watch", daemon=True).start()


def _wait_and_exit(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)
