"""How torch's CPU thread pool behaves on a machine it shares: how many threads, and how idle ones wait.

Each torch operator on the CPU splits its work evenly over the pool's OpenMP threads and waits for the last of them.
GNU OpenMP's idle threads spin (about 300,000 turns) before they sleep: with one core busy with another process, the
spinning threads hold the cores that the thread sharing the busy core needs, so every operator waits for a time
slice, and a 2-core decode step took 18-24 times as long (`yes > /dev/null` beside `nv bench --device cpu
--latency`). Threads that sleep as soon as they are idle (OMP_WAIT_POLICY=PASSIVE) give the cores back: the
scheduler then runs the woken thread at once, ahead of the busy process. `benchmarks/cpu_busy_core.py` measures both.

OpenMP reads its wait policy once, when torch's library loads, so `prefer_passive_wait` must run before torch is
imported: nv's command line and `from nvcli import LLM` call it first. A policy the user set (OMP_WAIT_POLICY,
GOMP_SPINCOUNT, KMP_BLOCKTIME) is left alone. The thread count is per calling thread in OpenMP;
`set_cpu_threads` sets it for the thread that builds the engine, which is the one that steps it, and for threads that
start torch work later (torch copies it to them).

The thread count stays torch's (one per CPU) unless --cpu-threads sets it. Sleeping threads win their core back from
a busy process as soon as they wake, so fewer threads only give speed away: on 2 CPUs beside `yes`, two sleeping
threads decoded at 61 ms/token where one thread per core left free (the count following /proc/stat every second)
took 132. Sleeping has a price on an idle machine, a wake-up per operator: 71-75 ms/token against 62-64 spinning.
A short spin (GOMP_SPINCOUNT=10000) kept the idle speed but took 100-200 ms/token beside `yes`; set it, or
OMP_WAIT_POLICY=ACTIVE, where no other process competes for the cores.
"""

from __future__ import annotations

import os
import sys

# the variables that set how idle OpenMP threads wait (GNU's and LLVM / Intel's runtimes)
WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def has_nvidia_gpu() -> bool:
    """Whether this machine has an NVIDIA driver (torch not loaded yet: the driver's files tell)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


def prefer_passive_wait() -> bool:
    """Idle OpenMP threads sleep at once (OMP_WAIT_POLICY=PASSIVE) unless the user chose a wait policy, torch has
    loaded already (too late: the runtime has read it) or the machine has a GPU (the engine then runs there; the
    host's torch work was measured with the runtime's default policy); whether it was set here."""
    if "torch" in sys.modules or any(os.environ.get(name) for name in WAIT_POLICY_VARIABLES) or has_nvidia_gpu():
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def default_cpu_threads() -> int:
    """torch's own default: one thread per CPU this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call (macOS)
        return max(1, os.cpu_count() or 1)


def set_cpu_threads(threads: int | None) -> int:
    """Run torch's CPU operators on `threads` threads; None keeps torch's count (default_cpu_threads(), or what
    OMP_NUM_THREADS says). The count in use."""
    import torch

    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
