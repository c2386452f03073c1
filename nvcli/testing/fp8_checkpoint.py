"""Block-wise FP8 checkpoints written from plain ones, as Qwen and DeepSeek publish them, and back.

`write_fp8_checkpoint` quantizes every decoder projection (q/k/v/o, gate/up/down, and each expert's gate/up/down of a
mixture-of-experts model, as Qwen publishes Qwen3-MoE FP8) of a safetensors checkpoint to float8_e4m3fn with
`<name>.weight_scale_inv` beside it (one float32 scale per 128 x 128 block, kernels/block_fp8.py) and adds
`quantization_config` to config.json; embeddings, norms, the LM head and a MoE router keep their dtype.
`write_dequantized_checkpoint` writes the weights such a checkpoint holds (fp8 times scale) as a plain float32
checkpoint: the reference a float run of transformers gives for the FP8 model. `write_per_tensor_dequantized`
writes the weights `--quantization fp8` makes of a plain checkpoint where it quantizes per tensor (layers/fp8.py: one
scale per checkpoint tensor; a MoE block's experts block-wise), dequantized to float32.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nvcli.kernels.block_fp8 import (
    FP8_DTYPE,
    dequantize_weight,
    quantize_weight,
    quantize_weight_per_tensor,
)

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}
# every decoder projection, a mixture-of-experts block's per-expert tensors too (not its router, `mlp.gate`)
PROJECTION = re.compile(r"\.layers\.\d+\.(self_attn|mlp|mlp\.experts\.\d+)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def _copy_other_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)


def _save(out: dict[str, torch.Tensor], src: Path, dst: Path, **config_changes: Any) -> Path:
    """`out` as dst's one safetensors file, and src's config.json with `config_changes` (None: the key removed)."""
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """`src`'s checkpoint in `dst` with its decoder projections in block-wise FP8 (one safetensors file)."""
    src, dst = Path(src), Path(dst)
    _copy_other_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in _tensors(src).items():
        if PROJECTION.search(name):
            out[name], out[name + "_scale_inv"] = quantize_weight(t)
        else:
            out[name] = t.contiguous()
    return _save(out, src, dst, quantization_config=QUANTIZATION_CONFIG)


def write_dequantized_checkpoint(fp8_dir: Path, dst: Path) -> Path:
    """The weights FP8 checkpoint `fp8_dir` holds, dequantized to float32, as a plain checkpoint in `dst`."""
    fp8_dir, dst = Path(fp8_dir), Path(dst)
    _copy_other_files(fp8_dir, dst)
    tensors = _tensors(fp8_dir)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        out[name] = dequantize_weight(t, tensors[name + "_scale_inv"], torch.float32) if t.dtype == FP8_DTYPE else t
    return _save(out, fp8_dir, dst, quantization_config=None, torch_dtype="float32")


def write_per_tensor_dequantized(src: Path, dst: Path) -> Path:
    """The weights `--quantization fp8` runs on where it quantizes per tensor, for `src`'s plain checkpoint, as a
    float32 checkpoint in `dst`."""
    src, dst = Path(src), Path(dst)
    _copy_other_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in _tensors(src).items():
        match = PROJECTION.search(name)
        if match is None:
            out[name] = t.contiguous()
        elif "experts" in match.group(1):
            out[name] = dequantize_weight(*quantize_weight(t), torch.float32)
        else:
            q, scale = quantize_weight_per_tensor(t)
            out[name] = q.float() * scale
    return _save(out, src, dst, torch_dtype="float32")
