"""FP8 projections: which linear layers hold block-wise FP8 weights, how checkpoint tensors and scales load into
them, and what happens to them once loaded.

Two ways in, one format (kernels/block_fp8.py: float8_e4m3fn, one float32 scale per 128 x 128 block):

* an FP8 checkpoint (config.json `quantization_config` with quant_method fp8, as Qwen and DeepSeek publish them):
  each projection's weight is fp8 and `<name>.weight_scale_inv` holds its block scales;
* `--quantization fp8` on a bf16 / fp32 checkpoint (or dummy weights): each tensor is quantized as it loads, on the
  layer's device. Where the GEMMs run row-scaled (below) with one scale for the whole tensor (vLLM's online FP8),
  written into every block's scale; a fused layer's parts (q / k / v, gate / up) keep one each, and the kernels
  that consume the output apply their ratios to the largest (`RowScaled.ratios`). Elsewhere (tensor parallelism,
  the CPU, GPUs without that GEMM) per 128 x 128 block, exactly as a checkpoint stores it.

A per-tensor layer runs every step on one rank through cuBLASLt's tensor-scaled FP8 GEMM with each activation row
(token) quantized with its own scale, which the GEMM leaves pending in its output (kernels/fp8_rows.py,
`RowScaled`): at decode sizes that GEMM streams the weight 1.3-2.4x faster than the block-scaled one, and prompt
steps run 6% faster than with per-token, per-128-column activation scales, for a small quality cost
(benchmarks/RESULTS.md). Block-wise layers quantize their activations per token and 128 columns (kernels/fp8_gemm.py).

The layers to quantize are the model's tensor-parallel projections (q/k/v, o, gate/up, down), built inside
`fp8_projections(spec)`, and a mixture-of-experts block's experts (layers/moe_fp8.py, per expert tensor);
embeddings, norms, the LM head and the router stay in the model dtype.
A fused layer stacks its shards' scales along the output rows; where a shard does not start and end on a 128-row
boundary of the fused weight (k / v of a small model, a tensor-parallel slice inside a block), the layer keeps one
scale per row instead (`scale_rows` 1): each row the scale of its own checkpoint block. A row-parallel split must
not cut a 128-column block of a checkpoint's scales (ConfigError naming --tensor-parallel-size).

After loading, `finish_fp8_layers` keeps the FP8 weights where the GPU has FP8 tensor cores (compute capability 8.9
or newer: kernels/fp8_gemm.py runs them), else dequantizes them once to the model dtype: the CPU and older GPUs run
the model dtype's kernels on the dequantized weights, so a CPU run equals a float run on those weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from nvcli.config import ConfigError
from nvcli.kernels.block_fp8 import (
    BLOCK,
    FP8_DTYPE,
    dequantize_weight,
    fp8_linear_ref,
    quantize_weight,
    quantize_weight_per_tensor,
)
from nvcli.kernels.ops import use_triton


@dataclass(frozen=True)
class Fp8Spec:
    """How a model's projections are FP8: `checkpoint` True when the checkpoint stores them so (scales beside the
    weights), False when they are quantized as they load (--quantization fp8); `per_tensor`: quantized with one scale
    per weight (`row_scaled_gemms`), else per 128 x 128 block."""

    checkpoint: bool
    per_tensor: bool = False


_active: Optional[Fp8Spec] = None


@contextmanager
def fp8_projections(spec: Optional[Fp8Spec]) -> Iterator[None]:
    """Within: the projections constructed are FP8 per `spec` (None: in the model dtype)."""
    global _active
    before, _active = _active, spec
    try:
        yield
    finally:
        _active = before


def active_fp8() -> Optional[Fp8Spec]:
    """The spec projections constructed now take (layers/linear.py)."""
    return _active


def fp8_spec(quantization: Optional[str], checkpoint: Optional[Mapping[str, Any]], device: torch.device,
             dtype: torch.dtype, tp: int) -> Optional[Fp8Spec]:
    """The FP8 spec of a model: from its checkpoint's quantization_config (ModelConfig.quantization, already checked
    to be block-wise fp8) or the --quantization flag (EngineConfig.quantization); None for neither. The flag
    quantizes per tensor where the GEMMs then run row-scaled (`row_scaled_gemms`), else as a checkpoint is."""
    if checkpoint is None and quantization is None:
        return None
    if checkpoint is not None:
        return Fp8Spec(checkpoint=True)
    return Fp8Spec(checkpoint=False, per_tensor=row_scaled_gemms(device, dtype, tp))


def row_scaled_gemms(device: torch.device, dtype: torch.dtype, tp: int) -> bool:
    """Whether --quantization fp8's GEMMs can run row-scaled (kernels/fp8_rows.py: one rank, a GPU whose
    tensor-scaled FP8 GEMM runs right), which needs one scale per weight. Elsewhere the weights keep 128 x 128 blocks,
    which cost less quality (benchmarks/RESULTS.md) and run as fast there."""
    if tp != 1 or device.type != "cuda":
        return False
    from nvcli.kernels.fp8_rows import tensor_gemm_supported  # triton: imported on demand

    return tensor_gemm_supported(device, dtype)


def _tp_cut(tp: int, what: str, in_features: int) -> ConfigError:
    return ConfigError(f"--tensor-parallel-size={tp}: {what} has {in_features} input features, {in_features // tp} "
                       f"per rank, which cuts the FP8 checkpoint's {BLOCK}-column scale blocks; choose a size that "
                       f"leaves a multiple of {BLOCK} per rank")


def check_tp_split(quantization: Optional[Mapping[str, Any]], row_parallel: dict[str, int], tp: int) -> None:
    """Before any rank starts: an FP8 checkpoint (`quantization`, ModelConfig.quantization) split over `tp` ranks
    leaves each rank of a row-parallel projection (name -> input features) whole 128-column scale blocks."""
    if quantization is None or tp == 1:
        return
    for what, in_features in row_parallel.items():
        if in_features % tp == 0 and (in_features // tp) % BLOCK:
            raise _tp_cut(tp, what, in_features)


def row_scaled(state: Optional[Fp8Weights]) -> Optional[torch.Tensor]:
    """The one weight scale of a per-tensor layer, whose GEMM runs row-scaled (kernels/fp8_rows.py), else None; a
    layer with a bias (Qwen2's q / k / v) runs block-scaled. Only one rank has per-tensor layers (`row_scaled_gemms`):
    under tensor parallelism a row-parallel layer's ranks would each leave their own row scales on a share of the
    sum."""
    if state is None or state.tensor_scale is None or state.layer.bias is not None:
        return None
    return state.tensor_scale


@dataclass
class RowScaled:
    """A row-scaled GEMM's output: row i of the product is scale[i] * values[i] (kernels/fp8_rows.py). Its consumer
    applies the scale as it loads the rows: the next add+RMSNorm (`x_scale`), SiLU-and-mul and the rotary kernels
    (their precomputed row scale)."""

    values: torch.Tensor  # [rows, N] in the model dtype
    scale: torch.Tensor  # [rows] float32
    # a fused weight whose parts (q / k / v, gate / up) kept a scale each: each part's factor [parts] (what the
    # rotary and SiLU kernels take) and each column's [N]; None where the parts share one scale
    ratios: Optional[torch.Tensor] = None
    col_scale: Optional[torch.Tensor] = None

    def materialize(self) -> torch.Tensor:
        from nvcli.kernels.fp8_rows import apply_row_scale

        return apply_row_scale(self.values, self.scale, self.col_scale)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
               scale_rows: int, scale_mm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ dequant(weight).T (+ bias), activations quantized per token per 128 columns: kernels/fp8_gemm.py on a GPU
    (`scale_mm`: the scales in cuBLASLt's layout, where its GEMM may run), its torch reference elsewhere."""
    if use_triton(x):
        from nvcli.kernels.fp8_gemm import fp8_linear_gpu

        return fp8_linear_gpu(x, weight, scale, bias, scale_rows, scale_mm)
    return fp8_linear_ref(x, weight, scale, bias, scale_rows)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Weights:
    """A projection's FP8 state: its scales [ceil(out / scale_rows), ceil(in / 128)] (float32, a buffer of the
    layer) and which shards have their weight and their scales.

    `shards`: shard id -> (first row in the layer, rows) of this rank; `column`: this rank's rows are rows
    [rank * rows, (rank + 1) * rows) of each checkpoint tensor (column-parallel and fused layers), else all of them;
    `row_split`: the input features are split across ranks (row-parallel), this rank holding columns
    [rank * in, (rank + 1) * in)."""

    def __init__(self, layer: nn.Module, spec: Fp8Spec, shards: dict[Any, tuple[int, int]], column: bool,
                 row_split: bool, what: str) -> None:
        out_features, in_features = layer.weight.shape
        self.tp_rank, self.tp_size = layer.tp_rank, layer.tp_size
        self.shards, self.column, self.row_split = shards, column, row_split
        if spec.checkpoint and row_split and self.tp_size > 1 and in_features % BLOCK:
            raise _tp_cut(self.tp_size, what, in_features * self.tp_size)
        last = max(offset for offset, _ in shards.values())
        aligned = all(offset % BLOCK == 0 and (rows % BLOCK == 0 or (offset == last and (self.tp_size == 1 or not column)))
                      for offset, rows in shards.values())
        self.scale_rows = BLOCK if aligned else 1
        self.per_tensor = spec.per_tensor  # quantized here, one scale per tensor
        layer.register_buffer("weight_scale", torch.ones(_cdiv(out_features, self.scale_rows),
                                                         _cdiv(in_features, BLOCK), dtype=torch.float32),
                              persistent=False)
        self.layer = layer
        self.fp8_weights: set[Any] = set()  # shards whose weight arrived in fp8
        self.scaled: set[Any] = set()  # shards whose scales are set (from the checkpoint or by quantizing)
        # the scales in cuBLASLt's layout, set after loading where its block-scaled GEMM runs (finish_fp8_layers)
        self.scale_mm: Optional[torch.Tensor] = None
        # a per-tensor layer's scales, set after loading where the tensor-scaled GEMM runs (finish_fp8_layers,
        # shard_scales): the GEMM's [1], each part's ratio to it [parts] and each column's [out] (None if all 1)
        self.tensor_scale: Optional[torch.Tensor] = None
        self.shard_ratios: Optional[torch.Tensor] = None
        self.col_ratios: Optional[torch.Tensor] = None

    def _write_scale(self, block_scale: torch.Tensor, offset: int, rows: int) -> None:
        """Scales of `rows` rows from `offset`, given per 128 rows from the first ([ceil(rows / 128), kb])."""
        dst = self.layer.weight_scale
        if self.scale_rows == 1:
            dst[offset : offset + rows].copy_(block_scale.repeat_interleave(BLOCK, 0)[:rows])
        else:
            dst[offset // BLOCK : offset // BLOCK + block_scale.shape[0]].copy_(block_scale)

    def store_weight(self, loaded: torch.Tensor, offset: int, shard: Any) -> None:
        """This rank's slice of a checkpoint tensor ([rows, in]) into rows from `offset`: fp8 as it is (its scales
        come as their own tensor), any other dtype quantized here, on the layer's device, with its scales."""
        weight = self.layer.weight.data
        dst = weight.narrow(0, offset, loaded.shape[0])
        if loaded.dtype == FP8_DTYPE:
            dst.copy_(loaded)
            self.fp8_weights.add(shard)
            return
        q, scale = self._quantize(loaded.to(weight.device))
        dst.copy_(q)
        self._write_scale(scale, offset, loaded.shape[0])
        self.scaled.add(shard)

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w [rows, in] -> (fp8, block scales [ceil(rows / 128), ceil(in / 128)]); per tensor: one scale in each."""
        if not self.per_tensor:
            return quantize_weight(w)
        q, scale = quantize_weight_per_tensor(w)
        return q, scale.reshape(1, 1).expand(_cdiv(w.shape[0], BLOCK), _cdiv(w.shape[1], BLOCK))

    def shard_scales(self) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """A per-tensor layer's scales once loaded: each checkpoint tensor (q / k / v, gate / up) keeps the one it was
        quantized with (a fused weight of one scale would cost its smaller parts precision: benchmarks/RESULTS.md).
        -> (the largest [1], which the tensor-scaled GEMM takes; each part's ratio to it [parts], in row order; the
        same per output row of the weight [out]); the ratios None where every part has the largest."""
        scale = self.layer.weight_scale
        parts = sorted(self.shards.values())  # (first row, rows)
        per_part = torch.stack([scale[first // self.scale_rows, 0] for first, _ in parts])
        for (first, rows), s in zip(parts, per_part):  # invariant: a part's rows all carry its scale
            rows_of = scale[first // self.scale_rows : _cdiv(first + rows, self.scale_rows)]
            assert bool((rows_of == s).all()), "a per-tensor part shares a scale block with another"
        common = per_part.max().reshape(1).clone()
        if bool((per_part == common).all()):
            return common, None, None
        ratios = (per_part / common).contiguous()
        sizes = torch.tensor([rows for _, rows in parts], device=ratios.device)
        return common, ratios, ratios.repeat_interleave(sizes).contiguous()

    def load_scale(self, scale: torch.Tensor, shard: Any, name: str) -> None:
        """A checkpoint's `weight_scale_inv` [ceil(rows / 128), ceil(in / 128)] of the whole tensor: this rank's
        part into the layer's scales."""
        offset, rows = self.shards[shard]
        in_features = self.layer.weight.shape[1]
        total_rows = rows * self.tp_size if self.column else rows
        total_in = in_features * self.tp_size if self.row_split else in_features
        want = (_cdiv(total_rows, BLOCK), _cdiv(total_in, BLOCK))
        if tuple(scale.shape) != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(scale.shape)}; block-wise FP8 scales of a "
                             f"[{total_rows}, {total_in}] weight have shape {want}")
        row_start = self.tp_rank * rows if self.column else 0
        col_block = self.tp_rank * in_features // BLOCK if self.row_split else 0
        per_row = scale.float().repeat_interleave(BLOCK, 0)[row_start : row_start + rows]
        per_row = per_row[:, col_block : col_block + _cdiv(in_features, BLOCK)].to(self.layer.weight_scale.device)
        dst = self.layer.weight_scale
        if self.scale_rows == 1:
            dst[offset : offset + rows].copy_(per_row)
        else:  # aligned: every 128th row starts a block
            dst[offset // BLOCK : offset // BLOCK + _cdiv(rows, BLOCK)].copy_(per_row[::BLOCK])
        self.scaled.add(shard)

    def load_dummy(self, generator: torch.Generator) -> None:
        """Random weights of the real shape (std 0.02, as loader.load_dummy_weights), quantized."""
        weight = self.layer.weight
        w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device).normal_(0.0, 0.02, generator=generator)
        q, scale = self._quantize(w)
        weight.data.copy_(q)
        self._write_scale(scale, 0, weight.shape[0])
        self.scaled.update(self.shards)

    def check_loaded(self, name: str) -> None:
        unscaled = self.fp8_weights - self.scaled
        if unscaled:
            raise ValueError(f"checkpoint has FP8 weights for {name} (shards {sorted(map(str, unscaled))}) without "
                             "their weight_scale_inv")


def finish_fp8_layers(model: nn.Module, keep: bool, dtype: torch.dtype) -> int:
    """After loading: every FP8 projection checked to have its scales, then kept in FP8 (`keep`: the GPU runs
    kernels/fp8_gemm.py, with the scales also in cuBLASLt's layout where its GEMM works) or dequantized to `dtype`
    (the layer then runs as any other). -> the number of FP8 layers."""
    if keep:
        from nvcli.kernels.fp8_gemm import cublas_eligible, cublas_supported, cublas_weight_scales
        from nvcli.kernels.fp8_rows import tensor_gemm_eligible, tensor_gemm_supported
    count = 0
    for name, module in model.named_modules():
        state: Optional[Fp8Weights] = getattr(module, "fp8", None)
        if not isinstance(state, Fp8Weights):
            continue
        state.check_loaded(name)
        count += 1
        if keep:
            weight = module.weight
            if (state.per_tensor and tensor_gemm_eligible(*weight.shape)
                    and tensor_gemm_supported(weight.device, dtype)):
                state.tensor_scale, state.shard_ratios, state.col_ratios = state.shard_scales()
            if cublas_eligible(*weight.shape, state.scale_rows) and cublas_supported(weight.device, dtype,
                                                                                          state.scale_rows):
                state.scale_mm = cublas_weight_scales(module.weight_scale, state.scale_rows)
            continue
        w = dequantize_weight(module.weight.data, module.weight_scale, dtype, state.scale_rows)
        module.weight = nn.Parameter(w, requires_grad=False)
        del module.weight_scale
        module.fp8 = None
    return count
