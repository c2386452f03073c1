"""Block-wise FP8 experts of Qwen3-MoE on the CPU: an FP8 checkpoint as Qwen publishes it (and --quantization fp8
on a float one) gives HF transformers' greedy tokens on the weights the FP8 checkpoint holds, dequantized; at --tp 2
over gloo too; a checkpoint's scale blocks cut by the split, or an expert without its scales, fail by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_fp8_weights import ENGINE, GREEDY, MAX_TOKENS, PROMPTS, checkpoint_factory, greedy, hf_greedy
from typer.testing import CliRunner

from nvcli import LLM
from nvcli.cli import app
from nvcli.config import ConfigError
from nvcli.kernels.block_fp8 import FP8_DTYPE, dequantize_weight
from nvcli.testing.fp8_checkpoint import write_per_tensor_dequantized

EXPERT = "model.layers.0.mlp.experts.{}.{}_proj.weight"
# at --tp 2 every rank's part of o_proj's input (256), the dense down_proj's (256) and each expert's intermediate
# dimension (256) is one whole 128-column block
ALIGNED = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
               moe_intermediate_size=256)
SHAPES = {"tiny": ("qwen3_moe", {}), "aligned": ("qwen3_moe", ALIGNED)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """shape -> (float qwen3_moe checkpoint, its FP8 checkpoint, the FP8 weights dequantized as float32)."""
    return checkpoint_factory(tmp_path_factory.mktemp("fp8_moe"), SHAPES)


def _experts(llm: LLM):
    return llm.engine.executor.runner.model.model.layers[0].mlp.experts


def test_the_checkpoint_holds_fp8_experts_and_a_float_router(checkpoints) -> None:
    _, fp8, _ = checkpoints("tiny")
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        up = f.get_tensor(EXPERT.format(3, "up"))
        scale = f.get_tensor(EXPERT.format(3, "up") + "_scale_inv")
        router = f.get_tensor("model.layers.0.mlp.gate.weight")
    assert up.dtype == FP8_DTYPE and up.shape == (32, 64) and scale.shape == (1, 1) and scale.dtype == torch.float32
    assert router.dtype == torch.float32 and "model.layers.0.mlp.gate.weight_scale_inv" not in names
    assert EXPERT.format(0, "down") + "_scale_inv" in names


def test_fp8_checkpoint_matches_hf_on_its_dequantized_weights(checkpoints) -> None:
    _, fp8, dequantized = checkpoints("tiny")
    assert greedy(fp8) == hf_greedy(dequantized)


def test_quantization_flag_quantizes_experts_at_load_and_matches_hf(checkpoints) -> None:
    """Each expert tensor quantized as it loads, as the FP8 checkpoint stores it, then dequantized once on the CPU."""
    plain, _, dequantized = checkpoints("tiny")
    llm = LLM(str(plain), quantization="fp8", **ENGINE)
    try:
        experts = _experts(llm)
        want = load_file(str(dequantized / "model.safetensors"))
        assert experts.fp8 is None and experts.gate_up_proj.dtype == torch.float32
        assert torch.equal(experts.gate_up_proj[2, 32:], want[EXPERT.format(2, "up")])
        assert torch.equal(experts.down_proj[1], want[EXPERT.format(1, "down")])
    finally:
        llm.shutdown()
    assert greedy(plain, quantization="fp8") == hf_greedy(dequantized)


def test_quantization_flag_quantizes_attention_per_tensor_where_the_gemms_run_row_scaled(checkpoints, tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """As on one GPU with the tensor-scaled FP8 GEMM: the attention projections per tensor, the experts block-wise
    (write_per_tensor_dequantized writes those weights)."""
    import nvcli.models.layers.fp8 as fp8_layers

    monkeypatch.setattr(fp8_layers, "row_scaled_gemms", lambda device, dtype, tp: tp == 1)
    plain, _, _ = checkpoints("tiny")
    assert greedy(plain, quantization="fp8") == hf_greedy(write_per_tensor_dequantized(plain, tmp_path / "ref"))


def test_tp2_over_gloo_loads_an_fp8_checkpoint(checkpoints) -> None:
    _, fp8, dequantized = checkpoints("aligned")
    assert greedy(fp8, tensor_parallel_size=2) == hf_greedy(dequantized)


def test_tp2_quantizes_each_ranks_slice_of_dummy_weights(checkpoints) -> None:
    """--quantization fp8 needs no aligned split: each rank quantizes its own 16 columns of every expert."""
    plain, _, _ = checkpoints("tiny")
    out = greedy(plain, load_format="dummy", quantization="fp8", tensor_parallel_size=2)
    assert all(len(tokens) == MAX_TOKENS for tokens in out)


def test_a_tp_split_through_an_experts_scale_block_is_refused(checkpoints, tmp_path: Path) -> None:
    _, fp8, _ = checkpoints("aligned")
    model_dir = tmp_path / "cut"
    shutil.copytree(fp8, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 128}))
    message = "=2: the experts' down_proj has 128 input features, 64 per rank"
    with pytest.raises(ConfigError, match=f"^tensor_parallel_size{message}"):
        LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    r = CliRunner().invoke(app, ["generate", "-", "--model", str(model_dir), "--tp", "2", "--device", "cpu",
                                 "--num-kvcache-blocks", "64", "--max-model-len", "256"], input="")
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--tensor-parallel-size{message}" in r.stderr, r.stderr


def test_an_expert_without_its_scales_is_named(checkpoints, tmp_path: Path) -> None:
    _, fp8, _ = checkpoints("tiny")
    model_dir = tmp_path / "broken"
    shutil.copytree(fp8, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors[EXPERT.format(2, "up") + "_scale_inv"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(experts 2.up_proj\) without their "
                                         "weight_scale_inv"):
        LLM(str(model_dir), **ENGINE)


def test_the_fp8_experts_path_runs_on_the_cpu_through_its_reference(checkpoints, monkeypatch) -> None:
    """Where FP8 GEMMs run (a GPU of compute capability 8.9+) the experts stay FP8 with their block scales; on the CPU
    the same path runs layers/moe_fp8.fused_experts_fp8_ref (activations quantized too)."""
    import nvcli.kernels.block_fp8 as block_fp8

    _, fp8, dequantized = checkpoints("tiny")
    monkeypatch.setattr(block_fp8, "fp8_gemm_supported", lambda device: True)
    llm = LLM(str(fp8), **ENGINE)
    try:
        experts = _experts(llm)
        assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.gate_up_scale.shape == (4, 2, 1)
        want = load_file(str(dequantized / "model.safetensors"))[EXPERT.format(3, "gate")]
        assert torch.equal(dequantize_weight(experts.gate_up_proj[3, :32], experts.gate_up_scale[3, :1],
                                             torch.float32), want)
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    ref = hf_greedy(dequantized)
    # activations in FP8 move the logits a little: the first tokens agree (the second prompt's fourth is a near tie,
    # 3.07 against 3.03 in HF's logits, that W8A8 turns)
    assert all(a[:3] == b[:3] for a, b in zip(out, ref)), (out, ref)



def test_fused_expert_tensors_quantize_per_expert_tensor() -> None:
    """transformers 5's fused expert tensors under --quantization fp8: each expert's gate, up and down quantized as the
    per-expert checkpoint tensors are (the gate and up halves with blocks of their own: 40 rows each)."""
    from nvcli.kernels.block_fp8 import quantize_weight
    from nvcli.models.layers.fp8 import Fp8Spec, fp8_projections
    from nvcli.models.layers.moe import FusedMoE

    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(3, 80, 64, generator=gen), torch.randn(3, 64, 40, generator=gen)
    with fp8_projections(Fp8Spec(checkpoint=False)):
        fused, per = FusedMoE(3, 64, 40), FusedMoE(3, 64, 40)
    fused.weight_loader(fused.gate_up_proj, gate_up)
    fused.weight_loader(fused.down_proj, down)
    for e in range(3):
        per.weight_loader(per.gate_up_proj, gate_up[e, :40], (e, 0))
        per.weight_loader(per.gate_up_proj, gate_up[e, 40:], (e, 1))
        per.weight_loader(per.down_proj, down[e], (e, None))
    for moe in (fused, per):
        moe.fp8.check_loaded("experts")
        q, s = quantize_weight(gate_up[2, 40:])
        assert torch.equal(moe.gate_up_proj[2, 40:].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(moe.gate_up_scale[2, 1:], s) and torch.equal(moe.down_scale[1], quantize_weight(down[1])[1])
    assert torch.equal(fused.down_proj.view(torch.uint8), per.down_proj.view(torch.uint8))
