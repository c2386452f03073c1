"""Qwen3-MoE end to end on CPU: greedy tokens equal HF transformers' (float32) in every scheduling regime and at
--tp 2 over gloo; both config spellings of the expert count, per-expert and fused expert tensors, dummy weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_vs_hf import GREEDY, PROMPTS, REGIMES, assert_all_blocks_free, check_greedy, hf_greedy

from nvcli import LLM, SamplingParams
from nvcli.models.model_config import load_model_config
from nvcli.models.presets import PRESETS

ENGINE = dict(device="cpu", num_kvcache_blocks=64, max_model_len=256)
SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_hf(tiny_model_dir, regime: str) -> None:
    """Layer 0 sparse (4 experts, top-2), layer 1 dense (mlp_only_layers); prompts of 5-70 tokens take the rows
    past the deferred-norm threshold, which a MoE model does not use."""
    check_greedy(tiny_model_dir, "qwen3_moe", regime, async_scheduling=False)


def test_the_tiny_model_has_both_kinds_of_layer(tiny_model_dir) -> None:
    from nvcli.models.layers.moe import SparseMoeBlock

    config = load_model_config(tiny_model_dir("qwen3_moe"))
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
    assert [config.is_moe_layer(i) for i in range(2)] == [True, False]
    llm = LLM(str(tiny_model_dir("qwen3_moe")), **ENGINE)
    model = llm.engine.executor.runner.model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [True, False]
    assert not model.model.can_defer_norm


def test_batch_invariant_matches_hf(tiny_model_dir) -> None:
    """--batch-invariant on the CPU runs every row alone (DecoderModel._forward_invariant): the MoE layer's forward,
    one token at a time, still gives HF's tokens."""
    model_dir = tiny_model_dir("qwen3_moe")
    outs = LLM(str(model_dir), batch_invariant=True, **ENGINE).generate(PROMPTS[:2], SHORT)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt)[:12]


def test_tp2_matches_hf(tiny_model_dir) -> None:
    """Each expert's intermediate dimension split over 2 gloo ranks, the router replicated."""
    model_dir = tiny_model_dir("qwen3_moe")
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        for prompt, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_tp_must_divide_the_expert_width(tiny_model_dir, tmp_path: Path) -> None:
    from nvcli.config import ConfigError

    model_dir = _copy(tiny_model_dir("qwen3_moe"), tmp_path / "odd")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 33}))
    with pytest.raises(ConfigError, match="moe_intermediate_size=33"):
        LLM(str(model_dir), tensor_parallel_size=2, load_format="dummy", **ENGINE)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_num_experts_spelled_as_qwen_publishes_it(tiny_model_dir, tmp_path: Path) -> None:
    """transformers 5.17 writes `num_local_experts`; Qwen's own config.json files say `num_experts`."""
    src = tiny_model_dir("qwen3_moe")
    assert "num_local_experts" in json.loads((src / "config.json").read_text())
    model_dir = _copy(src, tmp_path / "num_experts")
    config = json.loads((model_dir / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model_config(model_dir).num_experts == 4
    ref = LLM(str(src), **ENGINE).generate(PROMPTS[:2], SHORT)
    out = LLM(str(model_dir), **ENGINE).generate(PROMPTS[:2], SHORT)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_fused_expert_tensors_load(tiny_model_dir, tmp_path: Path) -> None:
    """A checkpoint with transformers 5's fused expert tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) runs as the per-expert one it was made from."""
    src = tiny_model_dir("qwen3_moe")
    tensors = load_file(str(src / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in tensors  # what save_pretrained writes
    prefix = "model.layers.0.mlp.experts"
    gate_up = [torch.cat([tensors.pop(f"{prefix}.{i}.gate_proj.weight"), tensors.pop(f"{prefix}.{i}.up_proj.weight")])
               for i in range(4)]
    down = [tensors.pop(f"{prefix}.{i}.down_proj.weight") for i in range(4)]
    tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
    tensors[f"{prefix}.down_proj"] = torch.stack(down)
    model_dir = _copy(src, tmp_path / "fused")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = LLM(str(src), **ENGINE).generate(PROMPTS[:2], SHORT)
    out = LLM(str(model_dir), **ENGINE).generate(PROMPTS[:2], SHORT)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_a_missing_expert_tensor_is_named(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("qwen3_moe")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    model_dir = _copy(src, tmp_path / "missing")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        LLM(str(model_dir), **ENGINE)


def test_dummy_weights(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir("qwen3_moe"), tmp_path / "dummy")
    (model_dir / "model.safetensors").unlink()
    llm = LLM(str(model_dir), load_format="dummy", **ENGINE)
    outs = llm.generate(PROMPTS, SHORT)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


def test_the_30b_preset_has_the_real_shape() -> None:
    """qwen3-30b-a3b as Qwen publishes it: 30.5B parameters, 3.3B active per token (built on the meta device)."""
    from nvcli.models.model_config import ModelConfig
    from nvcli.models.qwen3_moe import Qwen3MoeForCausalLM

    config = ModelConfig.from_dict(PRESETS["qwen3-30b-a3b"])
    assert all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    active = total - config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * expert
    assert round(total / 1e9, 1) == 30.5 and int(active / 1e8) == 33  # 3.35B
