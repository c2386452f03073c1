"""A mixture-of-experts block's routing, for its torch and Triton paths alike: each token's top-k experts and their
weights, and the tokens of each expert in the order transformers adds the experts' outputs."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F


def route(
    logits: torch.Tensor,  # [num_tokens, num_experts] router logits
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k] in logits' dtype, expert ids int64)
    """The top-k experts of each token and their routing weights (softmax in float32, renormalized if asked)."""
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
