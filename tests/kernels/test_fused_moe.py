"""kernels/fused_moe.py: the grouped GEMMs against layers/moe.py's torch reference (transformers' expert loop),
with uneven routing and an expert no token picks; the alignment's buffers are of fixed size whatever the routing,
and its kernel's outputs are the torch reference's, entry for entry."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, on_device

from nvcli.models.layers.moe import fused_experts_ref, route


def _inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int, dtype: torch.dtype,
            skew: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    weights, ids = routing(tokens, experts, top_k, dtype, skew, gen)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


def routing(tokens: int, experts: int, top_k: int, dtype: torch.dtype, skew: bool, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random router logits routed (weights, ids); `skew`: expert 1 is nearly everyone's first choice and the last
    expert nobody's."""
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:
        logits[:, 1] += 3.0
        logits[:, -1] = -30.0
    return route(logits.to(dtype), top_k, renormalize=True)


@pytest.mark.parametrize("tokens, experts, top_k, block_m", [
    (1, 4, 2, None),  # one decode row
    (7, 4, 2, 16),
    (13, 8, 2, None),
    (40, 8, 2, 64),  # groups larger than one block of some experts, smaller of others
    (5, 8, 1, 16),
])
@pytest.mark.parametrize("skew", [False, True])
def test_fused_moe_matches_the_reference(tokens: int, experts: int, top_k: int, block_m: int | None,
                                         skew: bool) -> None:
    from nvcli.kernels.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = _inputs(tokens, 64, 32, experts, top_k, seed=tokens + experts, dtype=torch.float32,
                                       skew=skew)
    if skew:
        assert not (ids == experts - 1).any()  # an expert with zero tokens
    expected = fused_experts_ref(x, w13, w2, weights, ids)
    got = on_device(fused_moe_triton)(x, w13, w2, weights, ids, block_m=block_m)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fused_moe_with_a_tensor_parallel_shard_and_odd_sizes() -> None:
    """Sizes off the block sizes (hidden 48, inter 24: masked columns) and a rank's half of the intermediate
    dimension laid out as FusedMoE holds it (its gate rows, then its up rows)."""
    from nvcli.kernels.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = _inputs(9, 48, 48, 6, 2, seed=3, dtype=torch.float32, skew=True)
    half = torch.cat([w13[:, :24], w13[:, 48:72]], dim=1).contiguous()  # rank 0 of 2
    down = w2[:, :, :24].contiguous()
    expected = fused_experts_ref(x, half, down, weights, ids)
    got = on_device(fused_moe_triton)(x, half, down, weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 tensor cores: on the GPU")
def test_fused_moe_bfloat16_on_the_gpu() -> None:
    from nvcli.kernels.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = _inputs(300, 256, 128, 16, 4, seed=5, dtype=torch.bfloat16, skew=True)
    expected = fused_experts_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    got = on_device(fused_moe_triton)(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def test_alignment_groups_rows_by_expert_in_buffers_of_fixed_size() -> None:
    from nvcli.kernels.fused_moe import moe_align

    ids = torch.tensor([[1, 3], [1, 0], [3, 1], [1, 3]])  # expert 2: no rows
    sorted_ids, expert_ids, num_padded = on_device(moe_align)(ids, 4, 4)
    rows = ids.numel()
    assert sorted_ids.shape == (-(-(rows + 4 * 3) // 4) * 4,)  # the worst case, whatever the routing
    assert int(num_padded) == 4 + 4 + 4  # expert 0: 1 row, 1: 4 rows, 3: 3 rows; each padded to 4
    used = sorted_ids[: int(num_padded)].view(-1, 4)
    flat = ids.flatten()
    for block, expert in zip(used, expert_ids.tolist()):
        real = block[block < rows]
        assert (flat[real.long()] == expert).all()
        assert real.tolist() == sorted(real.tolist())  # an expert's rows in token order
    assert sorted(sorted_ids[sorted_ids < rows].tolist()) == list(range(rows))  # every row exactly once
    assert expert_ids[: int(num_padded) // 4].tolist() == [0, 1, 3]
    same = on_device(moe_align)(torch.zeros_like(ids), 4, 4)  # every row to one expert: the same shapes
    assert same[0].shape == sorted_ids.shape and same[1].shape == expert_ids.shape


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs: on the GPU")
def test_fused_moe_captures_into_a_cuda_graph() -> None:
    """No host sync and no data-dependent shape: a graph captured with one routing replays another correctly."""
    from nvcli.kernels.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = (t.to(DEVICE) for t in _inputs(8, 64, 32, 8, 2, seed=1, dtype=torch.float32,
                                                                skew=False))
    fused_moe_triton(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    _, _, _, weights2, ids2 = _inputs(8, 64, 32, 8, 2, seed=2, dtype=torch.float32, skew=True)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    expected = fused_experts_ref(x.cpu(), w13.cpu(), w2.cpu(), weights2, ids2)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def _router_ids(tokens: int, top_k: int, experts: int, seed: int, hot: int | None = None) -> torch.Tensor:
    """[tokens, top_k] int64: distinct experts per token, as a router's top-k picks them; `hot`: only the first
    `hot` experts are ever picked (skewed routing, the others empty)."""
    gen = torch.Generator().manual_seed(seed)
    pool = hot or experts
    return torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)]).reshape(tokens, top_k)


@pytest.mark.parametrize("tokens, top_k, experts, block_m, hot", [
    (256, 8, 128, 16, None),  # a decode step of Qwen3-30B-A3B: groups of ~16 rows
    (256, 8, 128, 64, None),
    (512, 8, 128, 16, 8),  # every token to the same 8 experts: groups of 32 blocks, 120 experts empty
    (3, 2, 64, 16, None),  # fewer rows than experts
    (1, 8, 128, 64, None),  # one decode token: the tail past the last group is most of the buffers
    (1200, 4, 16, 64, 13),  # prefill-like: 4,800 rows (two of the kernel's 4,096-row chunks), 3 experts empty
])
def test_alignment_kernel_matches_the_reference(tokens: int, top_k: int, experts: int, block_m: int,
                                                hot: int | None) -> None:
    """sorted_ids, expert_ids and num_padded equal the torch reference's in every entry, the tail past num_padded
    included (sentinel rows, the last expert's id)."""
    from nvcli.kernels.fused_moe import moe_align, moe_align_ref

    ids = _router_ids(tokens, top_k, experts, seed=tokens + experts, hot=hot)
    want = moe_align_ref(ids, experts, block_m)
    got = on_device(moe_align)(ids, experts, block_m)
    for name, g, w in zip(("sorted_ids", "expert_ids", "num_padded"), got, want):
        assert g.dtype == w.dtype == torch.int32 and torch.equal(g, w), name


def test_alignment_kernel_takes_int32_ids_and_no_rows() -> None:
    from nvcli.kernels.fused_moe import moe_align, moe_align_ref

    ids = _router_ids(40, 2, 8, seed=7)
    for case in (ids.to(torch.int32), ids[:0]):
        want = moe_align_ref(case, 8, 16)
        got = on_device(moe_align)(case, 8, 16)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
