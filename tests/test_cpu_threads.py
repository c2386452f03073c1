"""nvcli/cpu_threads.py: idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the user chose a policy, set
before torch loads by both entry points; --cpu-threads sets the count, checked at construction."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvcli import cpu_threads
from nvcli.config import ConfigError, EngineConfig

ROOT = Path(__file__).resolve().parents[1]
PROBE = "import os; {entry}; import torch; print(os.environ.get('OMP_WAIT_POLICY'))"


def _child(entry: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in cpu_threads.WAIT_POLICY_VARIABLES}
    clean["PYTHONPATH"] = str(ROOT) + os.pathsep + clean.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", PROBE.format(entry=entry)], env={**clean, **env}, capture_output=True,
                       text=True, timeout=300, check=True)
    return r.stdout.strip()


def test_both_entry_points_make_idle_threads_sleep_before_torch_loads():
    """A core busy with another process made the spinning threads' decode 18-24x slower (benchmarks/cpu_busy_core.py)."""
    assert _child("from nvcli import LLM") == "PASSIVE"
    assert _child("from nvcli.cli import main; main()") == "PASSIVE"


def test_a_policy_the_user_set_is_kept():
    assert _child("from nvcli import LLM", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert _child("from nvcli import LLM", GOMP_SPINCOUNT="10000") == "None"


def test_too_late_once_torch_has_loaded(monkeypatch):
    import torch  # noqa: F401 - loaded: its OpenMP runtime has read the policy

    for name in cpu_threads.WAIT_POLICY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert cpu_threads.prefer_passive_wait() is False and "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_cpu_threads_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match="--cpu-threads: must be a positive integer"):
        EngineConfig(model="x", cpu_threads=bad)


def test_the_engine_runs_on_the_threads_asked_for(tiny_model_dir):
    import torch

    from nvcli import LLM, SamplingParams

    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=16, max_model_len=128, cpu_threads=1)
        assert torch.get_num_threads() == 1
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2
        llm.shutdown()
        LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=16, max_model_len=128).shutdown()
        assert torch.get_num_threads() == 1  # None keeps the count torch has
    finally:
        torch.set_num_threads(before)


def test_a_gpu_machine_keeps_the_runtimes_own_policy(monkeypatch):
    """The GPU engine's host work was measured with OpenMP's default policy: PASSIVE is for CPU-only machines."""
    monkeypatch.setattr(cpu_threads, "has_nvidia_gpu", lambda: True)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    for name in cpu_threads.WAIT_POLICY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert cpu_threads.prefer_passive_wait() is False and "OMP_WAIT_POLICY" not in os.environ
