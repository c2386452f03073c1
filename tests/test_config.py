"""Invalid settings fail at construction with a message naming the flag to change."""

from __future__ import annotations

import pytest

from nvcli.config import ConfigError, EngineConfig
from nvcli.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
        (dict(max_num_seqs=-1), "--max-num-seqs"),
        (dict(kvcache_block_size=24), "--block-size"),
        (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
        (dict(dtype="float64"), "--dtype"),
        (dict(kv_cache_dtype="int4"), "--kv-cache-dtype"),
        (dict(kv_cache_scale=0.0), "--kv-cache-scale"),
        (dict(kv_cache_scale=float("nan")), "--kv-cache-scale"),
        (dict(kv_cache_scale="1"), "--kv-cache-scale"),
        (dict(load_format="pickle"), "--load-format"),
        (dict(device="tpu"), "--device"),
        (dict(max_model_len=0), "--max-model-len"),
        (dict(structured_outputs_in_reasoning=True), "--structured-outputs-in-reasoning"),
        (dict(cpu_kvcache_space_gib=0), "--cpu-kvcache-space"),
        (dict(cpu_kvcache_space_gib=float("inf")), "--cpu-kvcache-space"),
        (dict(scheduling_policy="lifo"), "--scheduling-policy: must be one of fcfs, priority"),
    ],
)
def test_bad_engine_config_names_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        EngineConfig(model="x", **kwargs)


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32"])
def test_kv_cache_dtype_choices(kv: str) -> None:
    assert EngineConfig(model="x", kv_cache_dtype=kv, kv_cache_scale=0.5).kv_cache_dtype == kv


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=5), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(seed="x"), "seed"),
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(skip_special_tokens=0), "skip_special_tokens"),
        (dict(skip_special_tokens="no"), "skip_special_tokens"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_device_cuda_without_cuda_fails_at_construction(monkeypatch) -> None:
    """Not deep in the engine with torch's AssertionError ("Torch not compiled with CUDA enabled")."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=r"--device: cuda: this torch build has no CUDA support.*--device cpu"):
        EngineConfig(model="x", device="cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(ConfigError, match="--device: cuda: no CUDA device is visible"):
        EngineConfig(model="x", device="cuda")


def test_the_cpu_kv_cache_is_bounded_at_1_gib_by_default() -> None:
    """vLLM's 4 GiB made a 98 MB model's CPU job peak at 5.2 GB; 1 GiB holds 23k tokens of the default model."""
    assert EngineConfig(model="x").cpu_kvcache_space_gib == 1.0
    assert EngineConfig(model="x", cpu_kvcache_space_gib=0.25).cpu_kvcache_space_gib == 0.25
