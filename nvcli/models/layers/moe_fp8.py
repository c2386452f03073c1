"""Block-wise FP8 experts of a mixture-of-experts block (layers/moe.py's FusedMoE built inside
`fp8.fp8_projections`): how each expert's checkpoint tensors and scales load, the torch reference of the FP8
grouped GEMMs, and what happens to the experts once loaded.

The format is the dense projections' (kernels/block_fp8.py), per expert tensor: each expert's gate_proj, up_proj
and down_proj is float8_e4m3fn with one float32 scale per 128 x 128 block, as Qwen publishes Qwen3-MoE FP8 checkpoints
(`mlp.experts.{i}.gate_proj.weight` + `...weight_scale_inv`; the router `mlp.gate` stays in the model dtype). The
stacked parameters keep each tensor's blocks: `gate_up_scale` [E, 2 * ceil(I / 128), ceil(H / 128)] (the gate's
block rows, then the up's, so each half has its own blocks whatever I), `down_scale` [E, ceil(H / 128),
ceil(I / 128)], I being this rank's part of the intermediate dimension.

Two ways in, as for the dense projections: an FP8 checkpoint's fp8 tensors and their scales, or float tensors (a bf16
checkpoint with --quantization fp8, or dummy weights) quantized per expert tensor as they load, on the layer's device.
With tensor parallelism a rank holds columns [rank * I, (rank + 1) * I) of each expert's intermediate dimension: a
checkpoint's blocks must not be cut, so I must be a multiple of 128 when tp > 1 (ConfigError naming
--tensor-parallel-size); quantizing at load works for any I (each rank quantizes its own slice).

After loading, `finish_fp8_experts` keeps the experts in FP8 where the GPU has FP8 tensor cores (kernels/fused_moe_fp8
runs them), else dequantizes them once to the model dtype (the plain experts' kernels and reference then run).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nvcli.kernels.block_fp8 import (
    BLOCK,
    FP8_DTYPE,
    block_fp8_matmul_ref,
    dequantize_weight,
    quantize_activations_ref,
    quantize_weight,
)
from nvcli.kernels.ops import use_triton
from nvcli.models.layers.fp8 import Fp8Spec, _tp_cut
from nvcli.models.layers.moe_routing import routed_tokens

_PROJ = {0: "gate_proj", 1: "up_proj", None: "down_proj"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Experts:
    """A FusedMoE's FP8 state: its scale buffers (registered on the module) and which expert tensors have their weight
    and their scales. A tensor is keyed (expert, 0 gate | 1 up | None down)."""

    def __init__(self, moe: nn.Module, spec: Fp8Spec) -> None:
        experts, hidden, inter, tp = moe.num_experts, moe.hidden_size, moe.inter, moe.tp_size
        if spec.checkpoint and tp > 1 and inter % BLOCK:
            raise _tp_cut(tp, "the experts' down_proj", inter * tp)
        self.moe, self.inter = moe, inter
        self.tp_rank, self.tp_size = moe.tp_rank, tp
        self.nb_i, self.nb_h = _cdiv(inter, BLOCK), _cdiv(hidden, BLOCK)
        moe.register_buffer("gate_up_scale", torch.ones(experts, 2 * self.nb_i, self.nb_h, dtype=torch.float32),
                            persistent=False)
        moe.register_buffer("down_scale", torch.ones(experts, self.nb_h, self.nb_i, dtype=torch.float32),
                            persistent=False)
        for param, gate_up in ((moe.gate_up_proj, True), (moe.down_proj, False)):
            param.scale_loader = self.load_scale  # type: ignore[attr-defined]
            param.dummy_loader = partial(self.load_dummy, gate_up=gate_up)  # type: ignore[attr-defined]
        self.fp8_weights: set[tuple[int, Optional[int]]] = set()  # tensors whose weight arrived in fp8
        self.scaled: set[tuple[int, Optional[int]]] = set()  # tensors whose scales are set

    def _weight(self, expert: int, half: Optional[int]) -> torch.Tensor:
        n = self.inter
        if half is None:
            return self.moe.down_proj.data[expert]
        return self.moe.gate_up_proj.data[expert, half * n : (half + 1) * n]

    def _scales(self, expert: int, half: Optional[int]) -> torch.Tensor:
        if half is None:
            return self.moe.down_scale[expert]
        return self.moe.gate_up_scale[expert, half * self.nb_i : (half + 1) * self.nb_i]

    def store_weight(self, piece: torch.Tensor, expert: int, half: Optional[int]) -> None:
        """This rank's slice of one expert tensor (gate / up [I, H], down [H, I]): fp8 as it is (its scales come as
        their own tensor), any other dtype quantized here, on the layer's device, with its scales."""
        dst = self._weight(expert, half)
        if piece.dtype == FP8_DTYPE:
            dst.copy_(piece)
            self.fp8_weights.add((expert, half))
            return
        q, scale = quantize_weight(piece.to(dst.device))
        dst.copy_(q)
        self._scales(expert, half).copy_(scale)
        self.scaled.add((expert, half))

    def load_scale(self, scale: torch.Tensor, shard: tuple[int, Optional[int]], name: str) -> None:
        """A checkpoint's `weight_scale_inv` of one whole expert tensor: this rank's blocks into the layer's scales
        (the rank's slice starts on a block: checked at construction)."""
        expert, half = shard
        full = self.inter * self.tp_size
        hidden = self.moe.hidden_size
        want = (_cdiv(full, BLOCK), self.nb_h) if half is not None else (self.nb_h, _cdiv(full, BLOCK))
        if tuple(scale.shape) != want:
            rows, cols = (full, hidden) if half is not None else (hidden, full)
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(scale.shape)}; block-wise FP8 scales of a "
                             f"[{rows}, {cols}] weight have shape {want}")
        first = self.tp_rank * self.inter // BLOCK
        part = scale[first : first + self.nb_i] if half is not None else scale[:, first : first + self.nb_i]
        self._scales(expert, half).copy_(part.float())
        self.scaled.add((expert, half))

    def load_dummy(self, generator: torch.Generator, gate_up: bool) -> None:
        """Random weights (std 0.02, as loader.load_dummy_weights), quantized per expert tensor."""
        param = self.moe.gate_up_proj if gate_up else self.moe.down_proj
        for expert in range(self.moe.num_experts):
            for half in ((0, 1) if gate_up else (None,)):
                dst = self._weight(expert, half)
                w = torch.empty(dst.shape, dtype=torch.float32, device=param.device).normal_(0.0, 0.02,
                                                                                            generator=generator)
                self.store_weight(w, expert, half)

    def check_loaded(self, name: str) -> None:
        unscaled = sorted(self.fp8_weights - self.scaled, key=lambda t: (t[0], -1 if t[1] is None else t[1]))
        if unscaled:
            tensors = ", ".join(f"{e}.{_PROJ[h]}" for e, h in unscaled[:4]) + (" ..." if len(unscaled) > 4 else "")
            raise ValueError(f"checkpoint has FP8 weights for {name} (experts {tensors}) without their "
                             "weight_scale_inv")

    def dequantize(self, dtype: torch.dtype) -> None:
        """The experts' weights as `dtype` (each tensor times its block scales), the scales dropped: the module then
        runs as a plain FusedMoE."""
        moe, n = self.moe, self.inter
        w13 = torch.empty(moe.gate_up_proj.shape, dtype=dtype, device=moe.gate_up_proj.device)
        w2 = torch.empty(moe.down_proj.shape, dtype=dtype, device=moe.down_proj.device)
        for e in range(moe.num_experts):  # one expert at a time: float32 temporaries of one tensor only
            for half in (0, 1):
                w13[e, half * n : (half + 1) * n] = dequantize_weight(self._weight(e, half), self._scales(e, half),
                                                                      dtype)
            w2[e] = dequantize_weight(self._weight(e, None), self._scales(e, None), dtype)
        moe.gate_up_proj = nn.Parameter(w13, requires_grad=False)
        moe.down_proj = nn.Parameter(w2, requires_grad=False)
        del moe.gate_up_scale, moe.down_scale
        moe.fp8 = None


def finish_fp8_experts(model: nn.Module, keep: bool, dtype: torch.dtype) -> int:
    """After loading: every FP8 expert tensor checked to have its scales, then kept in FP8 (`keep`: the GPU runs
    kernels/fused_moe_fp8.py) or dequantized to `dtype`. -> the number of FP8 expert blocks (layers)."""
    count = 0
    for name, module in model.named_modules():
        state = getattr(module, "fp8", None)
        if not isinstance(state, Fp8Experts):
            continue
        state.check_loaded(name)
        count += 1
        if not keep:
            state.dequantize(dtype)
    return count


def fused_experts_fp8_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden] fp8: gate rows, then up rows
    w13_scale: torch.Tensor,  # [num_experts, 2 * ceil(inter / 128), ceil(hidden / 128)]
    w2: torch.Tensor,  # [num_experts, hidden, inter] fp8
    w2_scale: torch.Tensor,  # [num_experts, ceil(hidden / 128), ceil(inter / 128)]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:  # [num_tokens, hidden] in x's dtype
    """What kernels/fused_moe_fp8.fused_moe_fp8_triton computes, in torch: x quantized per token per 128 columns,
    each expert's gate and up as block-scaled FP8 products (float32, rounded to x's dtype), SiLU(gate) * up in x's
    dtype quantized per row per 128 columns, the down product rounded to x's dtype times the routing weight, added
    into the token's row (expert by expert, as layers/moe.fused_experts_ref)."""
    inter = w13.shape[1] // 2
    nb = _cdiv(inter, BLOCK)
    xq, xs = quantize_activations_ref(x)
    out = torch.zeros_like(x)
    for e, k_pos, tokens in routed_tokens(topk_ids, w13.shape[0]):
        a, a_s = xq[tokens], xs[tokens]
        gate = block_fp8_matmul_ref(a, a_s, w13[e, :inter], w13_scale[e, :nb]).to(x.dtype)
        up = block_fp8_matmul_ref(a, a_s, w13[e, inter:], w13_scale[e, nb:]).to(x.dtype)
        act, act_s = quantize_activations_ref(F.silu(gate) * up)
        h = block_fp8_matmul_ref(act, act_s, w2[e], w2_scale[e]).to(x.dtype) * topk_weights[tokens, k_pos, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out


def fused_experts_fp8(x: torch.Tensor, moe: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The FP8 experts of FusedMoE `moe` on x [num_tokens, hidden]: the Triton grouped GEMMs on CUDA tensors, the
    reference elsewhere."""
    args = (x, moe.gate_up_proj, moe.gate_up_scale, moe.down_proj, moe.down_scale, topk_weights, topk_ids)
    if use_triton(x):
        from nvcli.kernels.fused_moe_fp8 import fused_moe_fp8_triton

        return fused_moe_fp8_triton(*args)
    return fused_experts_fp8_ref(*args)
