"""StartupMarker: a later start-up skips the compile-ahead pass only when nothing that shapes the launches
changed (nvcli/kernels/compile_ahead.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvcli.kernels import compile_ahead
from nvcli.kernels.compile_ahead import StartupMarker

SETTINGS = [{"max_num_seqs": 512, "kv_cache_dtype": "auto"}, {"hidden_size": 1024}, 0]
GPU = "NVIDIA H100 80GB HBM3 sm_90"


@pytest.fixture(autouse=True)
def triton_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    return tmp_path / "triton"


def test_marker_written_is_found_by_the_same_start_up(triton_cache: Path):
    first = StartupMarker(SETTINGS, GPU)
    assert not first.exists()
    first.write(31)
    assert first.path.parent == triton_cache
    assert StartupMarker(SETTINGS, GPU).exists()


@pytest.mark.parametrize("change", ["settings", "gpu", "kernel source"])
def test_any_change_that_shapes_the_launches_makes_a_new_key(change: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "attention.py").write_text("BLOCK_N = 64\n")
    monkeypatch.setattr(compile_ahead, "KERNELS_DIR", kernels)
    StartupMarker(SETTINGS, GPU).write(31)
    settings, gpu = SETTINGS, GPU
    if change == "settings":
        settings = [{"max_num_seqs": 256, "kv_cache_dtype": "auto"}, {"hidden_size": 1024}, 0]
    elif change == "gpu":
        gpu = "NVIDIA H200 sm_90"
    else:
        (kernels / "attention.py").write_text("BLOCK_N = 128\n")
    assert not StartupMarker(settings, gpu).exists()


def test_an_unwritable_cache_directory_is_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker / "triton"))
    marker = StartupMarker(SETTINGS, GPU)
    marker.write(31)  # the next start-up compiles ahead again; this one must not fail
    assert not marker.exists()
