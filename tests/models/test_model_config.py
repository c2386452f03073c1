"""models/model_config.py: config.json read without transformers' config classes, the same as through them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nvcli.models.model_config import FAMILIES, ModelConfig, ModelConfigError, load_model_config
from nvcli.models.presets import PRESETS
from nvcli.testing.tiny_models import tiny_config

# keys a config.json may leave out, each taking the family's default
OPTIONAL_KEYS = ("vocab_size", "intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings",
                 "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "hidden_act",
                 "bos_token_id", "eos_token_id", "hidden_size", "num_hidden_layers", "num_attention_heads")
ROPES = {
    "legacy theta": {"rope_theta": 250_000.0},
    "llama3 in rope_scaling, no pre-training length": {
        "rope_theta": 500_000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    "linear with the old 'type' key": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "transformers 5 rope_parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "rope_parameters with scaling": {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072},
}

# Qwen2/Qwen3's sliding window: on only with use_sliding_window, for the layers from max_window_layers (default 28)
# on or those layer_types names; Llama has none, whatever its file says
SLIDING = {
    "sliding window off": {"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0},
    "sliding window, default layers": {"use_sliding_window": True, "sliding_window": 32},
    "sliding window from layer 1": {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
    "sliding window, default size": {"use_sliding_window": True, "max_window_layers": 0},
    "sliding window null": {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    "sliding window by layer_types": {"use_sliding_window": True, "sliding_window": 32,
                                      "layer_types": ["sliding_attention", "full_attention"]},
    "sliding window, layer_types all full": {"use_sliding_window": True, "sliding_window": 32,
                                             "layer_types": ["full_attention", "full_attention"]},
}


def _through_transformers(d: dict) -> ModelConfig:
    from transformers import AutoConfig

    d = dict(d)
    return ModelConfig.from_hf(AutoConfig.for_model(d.pop("model_type"), **d))


def _cases() -> list[tuple[str, dict]]:
    cases = []
    for arch in FAMILIES:
        full = tiny_config(arch)
        cases.append((f"{arch} tiny", full))
        for key in OPTIONAL_KEYS:
            cases.append((f"{arch} without {key}", {k: v for k, v in full.items() if k != key}))
        for key in ("head_dim", "num_key_value_heads"):
            # Qwen3Config refuses a null head_dim, Qwen3MoeConfig a null num_key_value_heads
            if (arch, key) not in (("qwen3", "head_dim"), ("qwen3_moe", "num_key_value_heads")):
                cases.append((f"{arch} {key} null", {**full, key: None}))
        for name, rope in ROPES.items():
            base = {k: v for k, v in full.items() if k not in ("rope_theta", "rope_scaling")}
            cases.append((f"{arch} {name}", {**base, **rope}))
        cases.append((f"{arch} eos list", {**full, "eos_token_id": [7, 8]}))
        for name, window in SLIDING.items():
            cases.append((f"{arch} {name}", {**full, **window}))
        cases.append((f"{arch} bare", {"model_type": arch, "architectures": full["architectures"]}))
    for name, preset in PRESETS.items():
        cases.append((f"preset {name}", dict(preset)))
    return cases


CASES = _cases()


@pytest.mark.parametrize("name,d", CASES, ids=[name for name, _ in CASES])
def test_each_family_reads_as_transformers_reads_it(name: str, d: dict) -> None:
    """Every key the engine uses resolves as transformers 5's class for the family resolves it, also where the file
    leaves it out (the family's defaults) or gives it in an older or newer form (rotary parameters). Where those
    defaults make a model the engine cannot run (Qwen's 32 KV heads beside 4 attention heads), both refuse it."""
    try:
        expected = _through_transformers(d)
    except ModelConfigError:
        with pytest.raises(ModelConfigError):
            ModelConfig.from_dict(d)
        return
    assert ModelConfig.from_dict(d) == expected


def test_a_wrong_family_default_is_caught() -> None:
    """The comparison above sees the defaults: a config without head_dim gets Qwen3's 128, not hidden // heads."""
    d = {k: v for k, v in tiny_config("qwen3").items() if k != "head_dim"}
    assert ModelConfig.from_dict(d).head_dim == _through_transformers(d).head_dim == 128
    d = {k: v for k, v in tiny_config("llama").items() if k != "head_dim"}
    assert ModelConfig.from_dict(d).head_dim == 64 // 4


def test_other_model_types_are_read_through_transformers(tmp_path: Path) -> None:
    """A model type outside FAMILIES still loads as before (transformers' config class), into the same record."""
    d = {**tiny_config("llama", rope_scaling=None), "model_type": "mistral", "architectures": ["MistralForCausalLM"],
         "sliding_window": None}
    (tmp_path / "config.json").write_text(json.dumps(d))
    config = load_model_config(tmp_path)
    assert config.model_type == "mistral" and config.architectures == ("MistralForCausalLM",)
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim, config.rope_theta) == (64, 2, 16, 5e5)


def test_the_sliding_window_is_read_where_a_layer_slides() -> None:
    """The equivalence cases above would pass if no case had a window: these must read one."""
    full = tiny_config("qwen2")
    assert ModelConfig.from_dict({**full, **SLIDING["sliding window from layer 1"]}).sliding_window == 32
    assert ModelConfig.from_dict({**full, **SLIDING["sliding window, default size"]}).sliding_window == 4096
    assert ModelConfig.from_dict({**full, **SLIDING["sliding window, default layers"]}).sliding_window is None
    assert ModelConfig.from_dict({**tiny_config("llama"), **SLIDING["sliding window from layer 1"]}).sliding_window is None


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 3}, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
    ({"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0}, "sliding_window must be a positive"),
])
def test_a_config_the_engine_cannot_run_fails_at_load_naming_the_key(tmp_path: Path, change: dict,
                                                                     message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**tiny_config("qwen3"), **change}))
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model_config(tmp_path)


@pytest.mark.parametrize("content,message", [(None, "no config.json"), ("{not json", "not valid JSON"),
                                             ("[1, 2]", "expected a JSON object")])
def test_a_missing_or_broken_config_json_is_named(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelConfigError, match=message):
        load_model_config(tmp_path)


def test_the_engine_refuses_such_a_model_before_loading_it(tiny_model_dir, tmp_path: Path) -> None:
    import shutil

    from nvcli import LLM

    src = tiny_model_dir("qwen3")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    with pytest.raises(ModelConfigError, match="hidden_act 'relu'"):
        LLM(str(bad), device="cpu")


def test_an_engine_starts_without_transformers_modeling_imports(tiny_model_dir) -> None:
    """The engine's config and tokenizer load skip transformers' modeling and generation packages (2.5-3 s of a
    start-up on the H100 host): a job in a fresh process never imports them."""
    code = (
        "import sys\n"
        "from nvcli import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir('qwen3'))!r}, device='cpu', max_model_len=64)\n"
        "out = llm.generate(['hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 2\n"
        "heavy = [m for m in ('transformers.models.auto.modeling_auto', 'transformers.generation.utils')"
        " if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "HEAVY []" in run.stdout, run.stdout


def test_a_sliding_window_model_runs_only_within_its_window(tmp_path: Path) -> None:
    """nv attends to the whole context. A Qwen model whose layers slide (use_sliding_window) is the same model only
    up to its window: the engine caps max_model_len there by default, refuses a longer --max-model-len, and within
    the window answers as transformers' sliding-window model does."""
    from nvcli import LLM, SamplingParams
    from nvcli.config import ConfigError
    from nvcli.testing.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "swa", "qwen3", use_sliding_window=True, sliding_window=48,
                                max_window_layers=1)
    with pytest.raises(ConfigError, match="max_model_len=64 exceeds the model's sliding attention window of 48"):
        LLM(str(model_dir), device="cpu", max_model_len=64, num_kvcache_blocks=64)
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64)
    assert llm.engine.max_model_len == 48
    prompt = list(range(1000, 1020))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True), use_tqdm=False)
    from tests.engine.test_engine_vs_hf import hf_greedy

    assert out[0].outputs[0].token_ids == hf_greedy(model_dir, prompt, 28)


@pytest.mark.parametrize("name,billions", [("llama-3-70b", 70.55), ("qwen3-32b", 32.76), ("qwen3-8b", 8.19)])
def test_dense_presets_have_their_published_parameter_counts(name: str, billions: float) -> None:
    c = ModelConfig.from_dict(dict(PRESETS[name]))
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    if c.model_type == "qwen3":
        layer += 2 * c.head_dim  # q and k norms
    total = c.num_hidden_layers * layer + c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    assert total / 1e9 == pytest.approx(billions, rel=0.01)
    assert c.num_key_value_heads % 4 == 0  # --tp 4 keeps whole KV heads per rank
