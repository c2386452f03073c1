"""A file that is not GGUF, or is cut short, and a cache directory that cannot be made: GGUFError (a one-line error
on the command line), never the gguf package's own ValueError or an OSError from deep in the conversion."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvcli.models import gguf as nvgguf
from nvcli.models.resolve import default_model_gguf


def test_a_file_that_is_not_gguf_is_a_gguf_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\0" * 4096)
    with pytest.raises(nvgguf.GGUFError, match=r"bad.gguf: not a valid GGUF file.*GGUF magic invalid"):
        nvgguf.convert_gguf_to_hf_dir(bad, cache_dir=tmp_path / "cache")


def test_a_truncated_gguf_is_a_gguf_error(tmp_path: Path) -> None:
    whole = default_model_gguf().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(nvgguf.GGUFError, match="cut.gguf: not a valid GGUF file, or a truncated one"):
        nvgguf.convert_gguf_to_hf_dir(cut, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("below", ["", "x"])
def test_a_cache_dir_that_cannot_be_made_is_a_cache_dir_error(tmp_path: Path, below: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(nvgguf.CacheDirError, match=r"nv's cache directory .* cannot be used \(Not a directory"):
        nvgguf.convert_gguf_to_hf_dir(default_model_gguf(), cache_dir=a_file / below if below else a_file)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_cache_dir_under_proc_is_a_cache_dir_error() -> None:
    with pytest.raises(nvgguf.CacheDirError, match="No such file or directory"):
        nvgguf.convert_gguf_to_hf_dir(default_model_gguf(), cache_dir=Path("/proc/x"))
