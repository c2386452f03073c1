"""A mixture-of-experts block's routing, for its torch and Triton paths alike: each token's top-k experts and their
weights, and the tokens of each expert in the order transformers adds the experts' outputs."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from nvcli.kernels.ops import use_triton

# kernels/moe_route.py mirrors torch's warp softmax, which takes rows of up to 1024 (wider ones: another order)
_KERNEL_MAX_EXPERTS = 1024


def route(
    logits: torch.Tensor,  # [num_tokens, num_experts] router logits
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k] in logits' dtype, expert ids int64)
    """The top-k experts of each token and their routing weights (softmax in float32, renormalized if asked): one
    Triton kernel on CUDA tensors (kernels/moe_route.py: torch's CUDA arithmetic op for op, its weights within a few
    ulps of torch's; equal probabilities to the lower expert id), else `route_ref`."""
    if use_triton(logits) and logits.shape[-1] <= _KERNEL_MAX_EXPERTS:
        from nvcli.kernels.moe_route import route_triton

        return route_triton(logits, top_k, renormalize)
    return route_ref(logits, top_k, renormalize)


def route_ref(
    logits: torch.Tensor,  # [num_tokens, num_experts] router logits
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k] in logits' dtype, expert ids int64)
    """`route` in torch ops: softmax in float32, the top k, renormalized to sum to 1 if asked, cast to logits'
    dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def routed_tokens(topk_ids: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, top-k positions, tokens) of every expert some token routes to, in increasing expert id: the order in
    which transformers' Qwen3MoeExperts adds the experts' outputs."""
    mask = F.one_hot(topk_ids, num_classes=num_experts).permute(2, 1, 0)  # [experts, top_k, tokens]
    for e in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
        k_pos, tokens = torch.where(mask[e])
        yield e, k_pos, tokens
