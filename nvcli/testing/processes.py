"""For tests of the worker processes nv starts: run a job that is then killed outright, and see which of its
workers outlive it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def running(pid: int) -> bool:
    """The process exists and has not ended (a zombie waiting for its parent's wait has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def workers_left_by_a_killed_job(script: str, tmp_path: Path, timeout: float = 20.0) -> tuple[list[int], bytes]:
    """Run `script` (Python that starts workers, prints their pids on one line, then SIGKILLs itself): the workers
    still running `timeout` seconds after it died (each then killed here), and what was left on its stdout (read
    once no worker is left: it ends only when nothing holds it open)."""
    path = tmp_path / "killed_job.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert workers and proc.wait(120) == -9, "the job did not start its workers, or was not killed"
    deadline = time.monotonic() + timeout
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if running(pid)]
    for pid in left:
        os.kill(pid, 9)
    return left, proc.stdout.read()
