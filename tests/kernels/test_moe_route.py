"""kernels/moe_route.py: the router's softmax, top-k, renormalization and cast in one kernel, against
models/layers/moe_routing.py's torch reference.

The kernel follows torch's CUDA arithmetic (its softmax's sum order, libdevice expf, IEEE divisions), but on an H100
its float32 weights still differed from torch's CUDA ops in their last bits; through the interpreter on the CPU the
kernel's exp is numpy's and the reference's torch's CPU exp. So: ids equal, float32 weights within a few ulps, 16-bit
weights within one 16-bit ulp (a float32 weight an ulp from a rounding boundary may round the other way). The
logits have no exact ties, where torch.topk's order is unspecified.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, on_device

from nvcli.kernels.moe_route import route_triton
from nvcli.models.layers.moe_routing import route_ref


def _logits(tokens: int, experts: int, top_k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[tokens, experts] random router logits in `dtype`, each row redrawn until its top_k + 1 largest values are
    distinct (16-bit logits tie often)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(tokens):
        while True:
            row = (torch.randn(experts, generator=gen) * 2).to(dtype)
            top = row.float().topk(min(top_k + 1, experts)).values
            if (top[:-1] != top[1:]).all():
                rows.append(row)
                break
    return torch.stack(rows) if rows else torch.zeros(0, experts, dtype=dtype)


@pytest.mark.parametrize("tokens, experts, top_k, dtype, renormalize", [
    (128, 128, 8, torch.float32, True),  # Qwen3-30B-A3B's router (128 experts, top 8)
    (128, 128, 8, torch.bfloat16, True),
    (64, 128, 8, torch.float32, False),
    (50, 60, 6, torch.float32, True),  # experts and k off powers of two; tokens off the 8 rows per program
    (21, 60, 6, torch.bfloat16, True),
    (7, 256, 8, torch.bfloat16, True),
    (5, 8, 2, torch.float16, False),
    (3, 4, 1, torch.float32, True),  # k = 1: every weight 1.0
])
def test_route_kernel_matches_the_reference(tokens: int, experts: int, top_k: int, dtype: torch.dtype,
                                            renormalize: bool) -> None:
    logits = _logits(tokens, experts, top_k, dtype, seed=tokens * experts + top_k)
    weights, ids = on_device(route_triton)(logits, top_k, renormalize)
    ref_weights, ref_ids = route_ref(logits.to(DEVICE), top_k, renormalize)  # torch's CUDA ops on the GPU
    ref_weights, ref_ids = ref_weights.cpu(), ref_ids.cpu()
    assert weights.dtype == dtype and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    if dtype == torch.float32:
        torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)
    else:
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(weights.float(), ref_weights.float(), rtol=ulp, atol=0)


def test_route_kernel_on_a_strided_view_and_no_tokens() -> None:
    logits = _logits(12, 64, 4, torch.float32, seed=3)
    wide = torch.cat([logits, torch.zeros(12, 16)], dim=1)[:, :64]  # rows 80 apart
    weights, ids = on_device(route_triton)(wide, 4, True)
    ref_weights, ref_ids = route_ref(logits, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=4e-7, atol=0)
    empty_w, empty_i = on_device(route_triton)(logits[:0], 4, True)
    assert empty_w.shape == empty_i.shape == (0, 4)


def test_route_kernel_breaks_ties_toward_the_lower_expert_id() -> None:
    """Equal probabilities: the lower expert id first (torch.topk leaves their order unspecified)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]])
    weights, ids = on_device(route_triton)(logits, 4, False)
    assert ids.tolist() == [[1, 3, 5, 2]]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] > weights[0, 3]
