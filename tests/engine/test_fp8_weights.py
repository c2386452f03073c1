"""FP8 weights on the CPU: a block-wise FP8 checkpoint gives HF transformers' greedy tokens on the weights it holds,
dequantized (at --tp 2 over gloo too); --quantization fp8 on a float checkpoint those of its quantized weights: block-
wise, or per tensor where the GEMMs run row-scaled, and then every step takes the row-scaled path; bad settings fail
with one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nvcli import LLM, SamplingParams
from nvcli.cli import app
from nvcli.config import ConfigError, EngineConfig
from nvcli.kernels.block_fp8 import FP8_DTYPE
from nvcli.models.model_config import ModelConfig, ModelConfigError
from nvcli.testing.fp8_checkpoint import (
    QUANTIZATION_CONFIG,
    write_dequantized_checkpoint,
    write_fp8_checkpoint,
    write_per_tensor_dequantized,
)
from nvcli.testing.tiny_models import make_tiny_model, tiny_config

PROMPTS = [list(range(1000, 1005)), list(range(2000, 2040)), list(range(3000, 3023))]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(device="cpu", num_kvcache_blocks=64, max_model_len=256)
# 128-row shards (q 256 rows, k and v 128 each, gate and up 256): block scales stacked whole, and at --tp 2 every
# rank's o_proj / down_proj input columns are one whole 128-column block
ALIGNED = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256)
SHAPES = {"qwen3": ("qwen3", {}), "llama": ("llama", {}), "qwen3_aligned": ("qwen3", ALIGNED)}


def checkpoint_factory(root: Path, shapes: dict[str, tuple[str, dict]]):
    """shape -> (float checkpoint, its FP8 checkpoint, the FP8 weights dequantized as a float32 checkpoint), each
    shape's (arch, config overrides) in `shapes`, made under `root` once."""
    cache: dict[str, tuple[Path, Path, Path]] = {}

    def make(shape: str) -> tuple[Path, Path, Path]:
        if shape not in cache:
            arch, overrides = shapes[shape]
            plain = make_tiny_model(root / shape / "plain", arch, **overrides)
            fp8 = write_fp8_checkpoint(plain, root / shape / "fp8")
            cache[shape] = plain, fp8, write_dequantized_checkpoint(fp8, root / shape / "dequantized")
        return cache[shape]

    return make


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    return checkpoint_factory(tmp_path_factory.mktemp("fp8"), SHAPES)


_hf: dict[str, list[list[int]]] = {}


def hf_greedy(model_dir: Path) -> list[list[int]]:
    if str(model_dir) not in _hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _hf[str(model_dir)] = [
            model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return _hf[str(model_dir)]


def greedy(model_dir: Path, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(model_dir), **{**ENGINE, **kwargs})
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def test_the_checkpoint_holds_fp8_projections_and_block_scales(checkpoints) -> None:
    from safetensors import safe_open

    plain, fp8, _ = checkpoints("qwen3")
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        scale = f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale_inv")
        embed = f.get_tensor("model.embed_tokens.weight")
    assert q.dtype == FP8_DTYPE and q.shape == (64, 64) and scale.shape == (1, 1) and scale.dtype == torch.float32
    assert embed.dtype == torch.float32 and "lm_head.weight_scale_inv" not in names
    assert ModelConfig.from_dict({**tiny_config("qwen3"), "quantization_config": QUANTIZATION_CONFIG}).quantization


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_checkpoint_matches_hf_on_its_dequantized_weights(checkpoints, shape: str) -> None:
    _, fp8, dequantized = checkpoints(shape)
    assert greedy(fp8) == hf_greedy(dequantized)


@pytest.fixture(scope="module")
def per_tensor(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights --quantization fp8 makes of the qwen3 shape's plain checkpoint, dequantized."""
    plain, _, _ = checkpoints("qwen3")
    return write_per_tensor_dequantized(plain, tmp_path_factory.mktemp("fp8") / "per_tensor")


def test_quantization_flag_matches_hf_on_quantized_then_dequantized_weights(checkpoints) -> None:
    """Where the GEMMs cannot run row-scaled (here: the CPU), each tensor is quantized as an FP8 checkpoint
    stores it, in 128 x 128 blocks."""
    plain, _, dequantized = checkpoints("qwen3")
    assert greedy(plain, quantization="fp8") == hf_greedy(dequantized)


def test_quantization_flag_quantizes_at_load_and_dequantizes_on_the_cpu(checkpoints) -> None:
    plain, _, dequantized = checkpoints("qwen3")
    llm = LLM(str(plain), quantization="fp8", **ENGINE)
    from safetensors import safe_open

    proj = llm.engine.executor.runner.model.model.layers[0].self_attn.o_proj
    with safe_open(str(dequantized / "model.safetensors"), framework="pt") as f:
        want = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
    with safe_open(str(plain / "model.safetensors"), framework="pt") as f:
        original = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
    assert proj.fp8 is None and proj.weight.dtype == torch.float32  # dequantized once at load (no FP8 GEMM here)
    assert torch.equal(proj.weight, want) and not torch.equal(want, original)
    llm.shutdown()


@pytest.fixture
def row_scaled_here(monkeypatch) -> None:
    """As where the GEMMs run row-scaled (one GPU with the tensor-scaled FP8 GEMM): --quantization fp8 quantizes
    per tensor."""
    import nvcli.models.layers.fp8 as fp8_layers

    monkeypatch.setattr(fp8_layers, "row_scaled_gemms", lambda device, dtype, tp: tp == 1)


def test_quantization_flag_matches_hf_on_its_per_tensor_quantized_weights(checkpoints, per_tensor,
                                                                          row_scaled_here) -> None:
    plain, _, _ = checkpoints("qwen3")
    assert greedy(plain, quantization="fp8") == hf_greedy(per_tensor)


def test_quantization_flag_quantizes_per_tensor_at_load(checkpoints, per_tensor, row_scaled_here) -> None:
    plain, _, _ = checkpoints("qwen3")
    llm = LLM(str(plain), quantization="fp8", **ENGINE)
    from safetensors import safe_open

    attn = llm.engine.executor.runner.model.model.layers[0].self_attn
    with safe_open(str(per_tensor / "model.safetensors"), framework="pt") as f:
        want = {p: f.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkvo"}
    with safe_open(str(plain / "model.safetensors"), framework="pt") as f:
        original = {p: f.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkvo"}
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    llm.shutdown()
    assert attn.o_proj.fp8 is None and attn.o_proj.weight.dtype == torch.float32  # dequantized once (no FP8 GEMM)
    assert torch.equal(attn.o_proj.weight, want["o"]) and not torch.equal(want["o"], original["o"])
    # q, k and v each keep their own scale (each weight is its fp8 value times it), then the norm's weight is folded
    for p in "qkv":
        scale = want[p].abs().max() / 448
        assert torch.equal((want[p] / scale).to(FP8_DTYPE).float() * scale, want[p])
    qkv = torch.cat([want["q"], want["k"], want["v"]])
    assert torch.equal(attn.qkv_proj.weight, qkv * norm[None, :])


def test_tp2_over_gloo_loads_an_fp8_checkpoint(checkpoints) -> None:
    _, fp8, dequantized = checkpoints("qwen3_aligned")
    assert greedy(fp8, tensor_parallel_size=2) == hf_greedy(dequantized)


def test_a_tp_split_through_a_scale_block_is_refused(checkpoints) -> None:
    _, fp8, _ = checkpoints("qwen3")  # o_proj has 128 input features: 64 per rank at --tp 2
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=2: o_proj has 128 input features, 64 per rank"):
        LLM(str(fp8), tensor_parallel_size=2, **ENGINE)
    r = CliRunner().invoke(app, ["generate", "-", "--model", str(fp8), "--tp", "2", "--device", "cpu",
                                 "--num-kvcache-blocks", "64", "--max-model-len", "256"], input="")
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--tensor-parallel-size=2: o_proj has 128 input features" in r.stderr, r.stderr


def test_dummy_weights_quantize(checkpoints) -> None:
    plain, _, _ = checkpoints("qwen3")
    out = greedy(plain, load_format="dummy", quantization="fp8")
    assert all(len(tokens) == MAX_TOKENS for tokens in out)


def test_the_fp8_gemm_path_runs_on_the_cpu_through_its_reference(checkpoints, monkeypatch) -> None:
    """Where FP8 GEMMs run (a GPU of compute capability 8.9+), the projections stay FP8 and the norms stay unfolded;
    on the CPU the same path runs kernels/block_fp8.fp8_linear_ref (activations quantized too)."""
    import nvcli.kernels.block_fp8 as block_fp8

    _, fp8, dequantized = checkpoints("qwen3")
    monkeypatch.setattr(block_fp8, "fp8_gemm_supported", lambda device: True)
    llm = LLM(str(fp8), **ENGINE)
    model = llm.engine.executor.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8_DTYPE and layer.self_attn.qkv_proj.fp8.scale_rows == 1
    assert not model.model.can_defer_norm and not torch.equal(layer.input_layernorm.weight,
                                                              torch.ones_like(layer.input_layernorm.weight))
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.shutdown()
    ref = hf_greedy(dequantized)
    # activations in FP8 move the logits a little: the first tokens agree
    assert all(a[:4] == b[:4] for a, b in zip(out, ref)), (out, ref)


def test_bad_settings_name_their_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--quantization: must be fp8, or left out .* \(got 'int4'\)$"):
        EngineConfig(quantization="int4")
    r = CliRunner().invoke(app, ["bench", "--load-format", "dummy", "--quantization", "awq", "--device", "cpu"])
    assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0 and "--quantization" in r.stderr, r.stderr
    for bad, word in (({"quant_method": "awq"}, "quant_method 'awq'"),
                      ({**QUANTIZATION_CONFIG, "weight_block_size": None}, "weight_block_size None"),
                      ({**QUANTIZATION_CONFIG, "activation_scheme": "static"}, "activation_scheme 'static'")):
        with pytest.raises(ModelConfigError, match=word):
            ModelConfig.from_dict({**tiny_config("qwen3"), "quantization_config": bad})


def test_a_missing_scale_is_named(checkpoints, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _, fp8, _ = checkpoints("qwen3")
    broken = write_fp8_checkpoint(checkpoints("qwen3")[0], tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.gate_up_proj \(shards \['1'\]\) without their "
                                         "weight_scale_inv"):
        LLM(str(broken), **ENGINE)


def test_every_step_of_a_per_tensor_layer_runs_row_scaled(checkpoints, monkeypatch) -> None:
    """Where the tensor-scaled FP8 GEMM runs, a --quantization fp8 layer (one scale per tensor) computes every step,
    prompt and decode alike, with each activation row quantized with its own scale (kernels/fp8_rows.py); where it
    does not, the layers are block-wise and every step quantizes per token and 128 columns. On the CPU each path
    runs its torch reference."""
    import nvcli.kernels.block_fp8 as block_fp8
    import nvcli.kernels.fp8_rows as fp8_rows
    import nvcli.models.layers.fp8 as fp8_layers

    rows: dict[str, list[int]] = {"row": [], "block": []}
    errors: list[float] = []
    product = fp8_rows.rows_product

    def row_path(x, wq, w_scale):
        rows["row"].append(x.shape[0])
        y, scale = product(x, wq, w_scale)
        block = block_fp8.fp8_linear_ref(x, wq, w_scale.reshape(1, 1).expand(-(-wq.shape[0] // 128),
                                                                            -(-wq.shape[1] // 128)), None)
        errors.append(float((fp8_rows.apply_row_scale(y, scale).float() - block.float()).norm() / block.norm()))
        return y, scale

    def block_path(x, *args, **kwargs):
        rows["block"].append(x.numel() // x.shape[-1])
        return block_fp8.fp8_linear_ref(x, *args, **kwargs)

    monkeypatch.setattr(block_fp8, "fp8_gemm_supported", lambda device: True)
    monkeypatch.setattr(fp8_rows, "rows_product", row_path)
    monkeypatch.setattr(fp8_layers, "fp8_linear_ref", block_path)
    plain, _, _ = checkpoints("qwen3")
    prompt_tokens = sum(len(p) for p in PROMPTS)
    for row_scaled in (False, True):
        monkeypatch.setattr(fp8_layers, "row_scaled_gemms", lambda device, dtype, tp, on=row_scaled: on)
        monkeypatch.setattr(fp8_rows, "tensor_gemm_supported", lambda device, dtype, on=row_scaled: on)
        rows["row"].clear()
        rows["block"].clear()
        llm = LLM(str(plain), quantization="fp8", **ENGINE)
        qkv = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == FP8_DTYPE and (qkv.fp8.tensor_scale is not None) == row_scaled
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.shutdown()
        assert all(len(t) == MAX_TOKENS for t in out)
        taken = rows["row" if row_scaled else "block"]
        assert not rows["block" if row_scaled else "row"], rows
        # the prompt step (every prompt token) and the decode steps (1-3 rows), in every projection
        assert max(taken) == prompt_tokens and min(taken) <= len(PROMPTS), taken
        assert len(taken) >= 4 * MAX_TOKENS
        if row_scaled:
            parts = [qkv.weight_scale[first // qkv.fp8.scale_rows, 0] for first, _ in sorted(qkv.fp8.shards.values())]
            assert torch.equal(qkv.weight_scale.unique().sort().values, torch.stack(parts).unique().sort().values)
    assert max(errors) < 0.08, max(errors)  # per-row against per-token, per-128-column activation scales


def test_the_flag_quantizes_per_tensor_only_where_the_gemms_run_row_scaled() -> None:
    """One scale per weight costs quality (benchmarks/RESULTS.md): only one rank on a GPU whose tensor-scaled FP8 GEMM
    works takes it; tensor parallelism and the CPU keep 128 x 128 blocks."""
    from nvcli.models.layers.fp8 import fp8_spec, row_scaled_gemms

    assert not row_scaled_gemms(torch.device("cpu"), torch.bfloat16, 1)
    assert not row_scaled_gemms(torch.device("cuda"), torch.bfloat16, 2)  # no GPU is asked: TP decides first
    assert fp8_spec("fp8", None, torch.device("cpu"), torch.bfloat16, 1).per_tensor is False
    assert fp8_spec(None, QUANTIZATION_CONFIG, torch.device("cuda"), torch.bfloat16, 1).per_tensor is False
