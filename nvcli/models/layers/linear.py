"""Linear layers sharded for tensor parallelism, each with a weight_loader for checkpoint tensors.

Column-parallel layers split the output features across ranks; row-parallel ones split the
input features and all-reduce the partial sums. Fused layers (qkv, gate_up) take each
checkpoint tensor with a shard id and copy it into their slice.

Built inside `fp8.fp8_projections`, the tensor-parallel layers hold block-wise FP8 weights (layers/fp8.py: `self.fp8`
holds their scales and how checkpoint tensors load into them; after loading they stay FP8 or become plain layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nvcli.distributed import (
    Partial,
    all_reduce,
    partial_target,
    reduce_target,
    sum_add_norm,
    summed_in_place,
    tp_rank,
    tp_size,
)
from nvcli.kernels.block_fp8 import FP8_DTYPE
from nvcli.kernels.ops import use_triton
from nvcli.models.layers.fp8 import Fp8Weights, RowScaled, active_fp8, fp8_linear, row_scaled


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """cuBLAS, or on the GPU for a few rows (decode of small batches) a weight-streaming Triton GEMM."""
    if use_triton(x):
        from nvcli.kernels.skinny_gemm import linear as skinny_or_cublas

        return skinny_or_cublas(x, weight, bias)
    return F.linear(x, weight, bias)


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by tensor_parallel_size={b}; choose another --tp")
    return a // b


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, shard_dim: int | None,
                 what: str = "a projection") -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard_dim = shard_dim
        spec = active_fp8() if shard_dim is not None else None  # replicated layers (a MoE router) stay unquantized
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE if spec else None),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.fp8: Fp8Weights | None = None
        if spec is not None:
            shards = {s: self.shard_rows(s) for s in self.shard_ids()}
            self.fp8 = Fp8Weights(self, spec, shards, column=shard_dim == 0, row_split=shard_dim == 1, what=what)
            self.weight.scale_loader = self.scale_loader  # type: ignore[attr-defined]
            self.weight.dummy_loader = self.fp8.load_dummy  # type: ignore[attr-defined]

    def shard_ids(self) -> list[int | str | None]:
        """The shard ids checkpoint tensors load with (None: one tensor, no id)."""
        return [None]

    def shard_rows(self, shard_id: int | str | None) -> tuple[int, int]:
        """(first row, rows) of a shard in this rank's weight."""
        return 0, self.weight.shape[0]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        offset, size = self.shard_rows(shard_id)
        if self.shard_dim == 0:  # column-parallel and fused: this rank's rows of the tensor (weight or bias)
            loaded = loaded.narrow(0, self.tp_rank * size, size)
        elif self.shard_dim == 1 and loaded.dim() == 2:  # row-parallel: this rank's input columns
            cols = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * cols, cols)
        if self.fp8 is not None and param is self.weight:
            self.fp8.store_weight(loaded, offset, shard_id)
        else:
            param.data.narrow(0, offset, loaded.shape[0]).copy_(loaded)

    def scale_loader(self, scale: torch.Tensor, shard_id: int | str | None = None, name: str = "") -> None:
        """A checkpoint's `weight_scale_inv` of the tensor that loads as `shard_id` (FP8 layers only)."""
        assert self.fp8 is not None
        self.fp8.load_scale(scale, shard_id, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            w_scale = row_scaled(self.fp8)
            if w_scale is not None:  # its row scales applied here (no consumer takes them)
                return self.forward_rows(x, w_scale).materialize().view(*x.shape[:-1], -1)
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.fp8.scale_rows, self.fp8.scale_mm)
        return linear(x, self.weight, self.bias)

    def forward_rows(self, x: torch.Tensor, w_scale: torch.Tensor) -> RowScaled:
        """A row-scaled FP8 layer's product (`w_scale`: layers/fp8.row_scaled's): x's rows quantized each with its
        own scale, the scales left pending in the output [rows, out]."""
        from nvcli.kernels.fp8_rows import rows_product

        x2 = x.reshape(-1, x.shape[-1])
        values, scale = rows_product(x2 if x2.stride(-1) == 1 else x2.contiguous(), self.weight, w_scale)
        return RowScaled(values, scale, self.fp8.shard_ratios, self.fp8.col_ratios)

    def _rows_output(self, q: torch.Tensor, q_scale: torch.Tensor, w_scale: torch.Tensor,
                     dtype: torch.dtype) -> RowScaled:
        """forward_rows' output for rows its producer already quantized (q, their scales)."""
        from nvcli.kernels.fp8_rows import rows_linear

        return RowScaled(rows_linear(q, self.weight, w_scale, dtype), q_scale, self.fp8.shard_ratios,
                         self.fp8.col_ratios)

    def forward_norm(self, x: torch.Tensor | Partial | RowScaled, residual: torch.Tensor | None,
                     norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor | RowScaled, torch.Tensor]:
        """(self(RMSNorm(x + residual)), x + residual) on the GPU: for a few rows one skinny-GEMM kernel with the norm
        in its prologue (kernels/skinny_gemm.norm_linear); an FP8 layer runs the add+RMSNorm kernel, then its GEMM
        (which quantizes the normed rows: quantizing inside the norm's one-program-per-row kernel measured 4.5x
        the pair's time, benchmarks/RESULTS.md). x a Partial (tensor parallelism): its sum across the ranks, the add
        and the norm in one kernel (distributed.sum_add_norm), then the GEMM. A row-scaled FP8 layer
        (layers/fp8.row_scaled): the norm kernel writes its rows quantized, and the output is RowScaled; x may be
        one (its scale applied in the same kernel)."""
        if isinstance(x, Partial):
            normed, residual = sum_add_norm(x, residual, norm_weight, eps)
            return self.forward(normed), residual
        from nvcli.kernels.rms_norm import rms_norm_triton

        x_scale = None
        if isinstance(x, RowScaled):  # a row-parallel projection's: one part (o_proj, down_proj), no column factors
            assert x.col_scale is None
            x, x_scale = x.values, x.scale
        w_scale = row_scaled(self.fp8)
        if w_scale is not None:
            q, q_scale, residual = rms_norm_triton(x, norm_weight, eps, residual, x_scale, quantize=True)
            return self._rows_output(q, q_scale, w_scale, x.dtype), residual
        if self.fp8 is None and x_scale is None:
            from nvcli.kernels.skinny_gemm import norm_linear

            return norm_linear(x, residual, norm_weight, eps, self.weight, self.bias)
        normed, residual = rms_norm_triton(x, norm_weight, eps, residual, x_scale)
        return self.forward(normed), residual


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, what: str = "a projection") -> None:
        super().__init__(in_features, _divide(out_features, tp_size(), "output features"), bias, 0, what)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate_up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, "gate_up_proj")

    def shard_ids(self) -> list[int | str | None]:
        return list(range(len(self.output_sizes)))

    def shard_rows(self, shard_id: int | str | None) -> tuple[int, int]:
        assert isinstance(shard_id, int)
        return sum(self.output_sizes[:shard_id]) // self.tp_size, self.output_sizes[shard_id] // self.tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its query heads and their KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, "qkv_proj")

    def shard_ids(self) -> list[int | str | None]:
        return ["q", "k", "v"]

    def shard_rows(self, shard_id: int | str | None) -> tuple[int, int]:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]  # type: ignore[index]


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, what: str = "a projection") -> None:
        super().__init__(_divide(in_features, tp_size(), "input features"), out_features, bias, 1, what)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if loaded.dim() == 1:  # the bias is added once, on rank 0 only (after the reduce it would count N times)
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x))

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor | Partial | RowScaled:
        """forward, leaving the sum across the ranks to the consumer where it can: cuBLAS writes this rank's share
        into a deferred-sum buffer (distributed.partial_target) and the next add+RMSNorm sums it (forward_norm);
        past that buffer's rows, into the symmetric all-reduce's buffer, summed there in place and read from there by
        the next add+RMSNorm (distributed.summed_in_place: no copy in or out); else forward (skinny and FP8 GEMMs,
        rows past both buffers). A row-scaled FP8 layer
        (layers/fp8.row_scaled, one rank): its rows quantized each with its own scale, the output RowScaled."""
        w_scale = row_scaled(self.fp8)
        if w_scale is not None:
            return self.forward_rows(x, w_scale)
        if self.fp8 is None and self.tp_size > 1 and x.is_cuda:
            from nvcli.kernels.skinny_gemm import use_skinny

            if not use_skinny(x, self.weight):
                rows, cols = x.numel() // x.shape[-1], self.weight.shape[0]
                p = partial_target(rows, cols, x.dtype, x.device)
                target = p.local if p is not None else reduce_target(rows, cols, x.dtype, x.device)
                if target is not None:
                    x2 = x.reshape(rows, x.shape[-1])
                    if self.bias is None:
                        torch.mm(x2, self.weight.t(), out=target)
                    else:
                        torch.addmm(self.bias, x2, self.weight.t(), out=target)
                    return p if p is not None else summed_in_place(target)
        return self.forward(x)

    def forward_silu_mul(self, gate_up: torch.Tensor | RowScaled) -> torch.Tensor | RowScaled:
        """forward(SiLU(gate) * up) from the fused gate_up output [..., 2 * in_features] (GPU only):
        for a few rows the activation is computed inside the GEMM's loads, one kernel instead of two (FP8 weights:
        the SiLU-and-mul kernel, writing its output quantized, then the FP8 GEMM). gate_up RowScaled (a row-scaled
        gate_up projection): SiLU-and-mul applies its scale; a row-scaled layer's output is RowScaled too."""
        w_scale = row_scaled(self.fp8)
        if w_scale is not None:
            from nvcli.kernels.activation import silu_and_mul_quant_rows_triton

            if isinstance(gate_up, RowScaled):
                values, scale, ratios = gate_up.values, gate_up.scale, gate_up.ratios
            else:
                values, scale, ratios = gate_up, None, None
            q, q_scale = silu_and_mul_quant_rows_triton(values.reshape(-1, values.shape[-1]), scale, ratios=ratios)
            return self._rows_output(q, q_scale, w_scale, values.dtype)
        if isinstance(gate_up, RowScaled):
            from nvcli.kernels.activation import silu_and_mul_triton

            return self.forward(silu_and_mul_triton(gate_up.materialize()))
        if self.fp8 is not None:  # SiLU-and-mul writes the FP8 GEMM's quantized input
            from nvcli.kernels.activation import silu_and_mul_quant_triton
            from nvcli.kernels.fp8_gemm import fp8_gemm_quantized

            rows = gate_up.reshape(-1, gate_up.shape[-1])
            q, q_scale = silu_and_mul_quant_triton(rows)
            out = fp8_gemm_quantized(q, q_scale, rows.shape[0], self.weight, self.weight_scale, self.bias,
                                     self.fp8.scale_rows, self.fp8.scale_mm, gate_up.dtype)
            return all_reduce(out.view(*gate_up.shape[:-1], -1))
        from nvcli.kernels.skinny_gemm import silu_mul_linear

        return all_reduce(silu_mul_linear(gate_up, self.weight, self.bias))

    def forward_silu_mul_partial(self, gate_up: torch.Tensor | RowScaled) -> torch.Tensor | Partial | RowScaled:
        """forward_silu_mul, leaving the sum to the consumer where forward_partial can (not for a few rows, whose
        SiLU-and-mul runs inside the skinny GEMM, nor for FP8 weights)."""
        from nvcli.kernels.skinny_gemm import use_skinny

        if isinstance(gate_up, RowScaled):
            return self.forward_silu_mul(gate_up)
        k = gate_up.shape[-1] // 2
        if self.fp8 is not None or self.tp_size == 1 or use_skinny(gate_up[..., :k], self.weight):
            return self.forward_silu_mul(gate_up)
        from nvcli.kernels.activation import silu_and_mul_triton

        return self.forward_partial(silu_and_mul_triton(gate_up.reshape(-1, 2 * k)).view(*gate_up.shape[:-1], k))
