"""Linear layers sharded for tensor parallelism, each with a weight_loader for checkpoint tensors.

Column-parallel layers split the output features across ranks; row-parallel ones split the
input features and all-reduce the partial sums. Fused layers (qkv, gate_up) take each
checkpoint tensor with a shard id and copy it into their slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nvcli.distributed import all_reduce, tp_rank, tp_size
from nvcli.kernels.ops import use_triton


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
    def __init__(self, in_features: int, out_features: int, bias: bool, shard_dim: int | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard_dim = shard_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.shard_dim is not None and self.shard_dim < loaded.dim():
            size = param.shape[self.shard_dim]
            loaded = loaded.narrow(self.shard_dim, self.tp_rank * size, size)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, _divide(out_features, tp_size(), "output features"), bias, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate_up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:  # type: ignore[override]
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        loaded = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its query heads and their KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:  # type: ignore[override]
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        loaded = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(loaded)


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(_divide(in_features, tp_size(), "input features"), out_features, bias, 1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() == 1:  # the bias is added once, on rank 0 only (after the reduce it would count N times)
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(linear(x, self.weight, self.bias))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(SiLU(gate) * up) from the fused gate_up output [..., 2 * in_features] (GPU only):
        for a few rows the activation is computed inside the GEMM's loads, one kernel instead of two."""
        from nvcli.kernels.skinny_gemm import silu_mul_linear

        return all_reduce(silu_mul_linear(gate_up, self.weight, self.bias))
