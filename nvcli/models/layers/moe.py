"""Sparse mixture-of-experts block (Qwen3-MoE): a replicated router, then each token through its top-k experts.

Router: logits = x @ Wg.T over the experts, softmax in float32, the top k, renormalized to sum to 1 when the model
says so (`norm_topk_prob`), then cast to the model dtype, as transformers' Qwen3MoeTopKRouter does.

Experts: every expert's gate and up projections are stacked into one parameter `gate_up_proj` [E, 2 * I, H] (gate
rows first) and its down projections into `down_proj` [E, H, I], the layout transformers 5 holds them in. A
checkpoint's per-expert tensors (`experts.{i}.gate_proj.weight`, ...) load into their expert's slice, the fused
tensors whole (`FusedMoE.weight_loader`). With tensor parallelism each expert's intermediate dimension is split
across the ranks (gate_up column-parallel, down row-parallel) and the block's output is summed across them, as the
dense MLP does; the router is replicated.

The CPU runs the torch reference (`fused_experts_ref`: expert by expert, the tokens routed to it, added back with
their routing weight, in transformers' order, so float32 outputs match it); CUDA tensors go through the grouped
GEMMs of kernels/fused_moe.py. Built inside `fp8.fp8_projections`, the experts hold block-wise FP8 weights
(layers/moe_fp8.py: `FusedMoE.fp8` holds their scales and how expert tensors load into them; after loading they stay
FP8, run by kernels/fused_moe_fp8.py, or become plain experts).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from nvcli.distributed import all_reduce, tp_rank, tp_size
from nvcli.kernels.block_fp8 import FP8_DTYPE
from nvcli.kernels.ops import use_triton
from nvcli.models.layers.fp8 import active_fp8
from nvcli.models.layers.linear import ReplicatedLinear, linear
from nvcli.models.layers.moe_fp8 import Fp8Experts, fused_experts_fp8
from nvcli.models.layers.moe_routing import route, routed_tokens


def fused_experts_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:  # [num_tokens, hidden]: sum over k of weight_k * down_e(SiLU(gate_e(x)) * up_e(x)), e = ids_k
    """The experts in torch, exactly as transformers' Qwen3MoeExperts computes them (the same ops in the same
    order): expert by expert in increasing id, its tokens gathered, the result times the routing weight added back."""
    out = torch.zeros_like(x)
    for e, k_pos, tokens in routed_tokens(topk_ids, w13.shape[0]):
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[tokens, k_pos, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """`fused_experts_ref`'s function: the Triton grouped GEMMs on CUDA tensors (`invariant`: one tile configuration
    whatever the row count, --batch-invariant), the reference elsewhere."""
    if use_triton(x):
        from nvcli.kernels.fused_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, invariant=invariant)
    return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    """The experts' weights, stacked; this rank's part of each expert's intermediate dimension."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by "
                             f"tensor_parallel_size={self.tp_size}; choose another --tp")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.inter = intermediate_size // self.tp_size  # this rank's columns of each expert
        spec = active_fp8()
        dtype = FP8_DTYPE if spec is not None else None
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter, dtype=dtype),
                                      requires_grad=False)
        for p, shards in ((self.gate_up_proj, 2 * num_experts), (self.down_proj, num_experts)):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            p.num_shards = shards  # type: ignore[attr-defined]  # per-expert tensors that make it whole (loader.py)
        self.fp8: Fp8Experts | None = Fp8Experts(self, spec) if spec is not None else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: Optional[tuple[int, Optional[int]]] = None) -> None:
        """Copy a checkpoint tensor into this rank's part: `shard` None for a fused tensor of every expert
        (gate_up_proj [E, 2 * I, H], down_proj [E, H, I]); (expert, 0 gate | 1 up) for one expert's gate_proj or
        up_proj [I, H]; (expert, None) for its down_proj [H, I]."""
        n, rank = self.inter, self.tp_rank
        full = n * self.tp_size
        gate_up = param is self.gate_up_proj
        if shard is None:
            want = (self.num_experts, 2 * full, self.hidden_size) if gate_up else (self.num_experts, self.hidden_size,
                                                                                   full)
            _check_shape(loaded, want)
            if self.fp8 is not None:  # expert tensor by expert tensor: each has block scales of its own
                for e in range(self.num_experts):
                    for half in ((0, 1) if gate_up else (None,)):
                        one = loaded[e] if half is None else loaded[e].narrow(0, half * full, full)
                        self.weight_loader(param, one, (e, half))
            elif gate_up:
                param.data[:, :n].copy_(loaded.narrow(1, rank * n, n))
                param.data[:, n:].copy_(loaded.narrow(1, full + rank * n, n))
            else:
                param.data.copy_(loaded.narrow(2, rank * n, n))
            return
        expert, half = shard
        if gate_up:
            assert half is not None
            _check_shape(loaded, (full, self.hidden_size))
            piece = loaded.narrow(0, rank * n, n)
        else:
            _check_shape(loaded, (self.hidden_size, full))
            piece = loaded.narrow(1, rank * n, n)
        if self.fp8 is not None:
            self.fp8.store_weight(piece, expert, half)
        elif gate_up:
            param.data[expert, half * n : (half + 1) * n].copy_(piece)
        else:
            param.data[expert].copy_(piece)


def _check_shape(loaded: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != want:
        raise ValueError(f"expert tensor of shape {tuple(loaded.shape)}, expected {want}")


class SparseMoeBlock(nn.Module):
    """Router and experts of one decoder layer (the module path matches transformers': mlp.gate, mlp.experts)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [num_tokens, hidden] (normed) -> the block's output [num_tokens, hidden], summed across ranks.
        `invariant` (GPU, --batch-invariant): the router and experts in kernels whose configuration ignores the
        row count."""
        if invariant:
            from nvcli.kernels.invariant_matmul import invariant_linear_triton

            logits = invariant_linear_triton(x, self.gate.weight)
        else:
            logits = linear(x, self.gate.weight, None)  # [num_tokens, num_experts]
        weights, ids = route(logits, self.top_k, self.norm_topk_prob)
        if self.experts.fp8 is not None:
            return all_reduce(fused_experts_fp8(x, self.experts, weights, ids))
        out = fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, invariant)
        return all_reduce(out)
