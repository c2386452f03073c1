"""The deferred tensor-parallel sum fused with add+RMSNorm (kernels/allreduce_norm.py): the ranks' shares here are
ordinary tensors standing in for the peer-mapped buffers; on the GPU when there is one, else under the interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, on_device

INTERPRETED = DEVICE.type == "cpu"


def _parts(world: int, rows: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, n, generator=gen).to(dtype) for _ in range(world)]


def _summed(parts: list[torch.Tensor]) -> torch.Tensor:
    """The all-reduced share as every rank gets it: rank order, fp32, rounded once."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(parts[0].dtype)


@pytest.mark.parametrize("world, rows, n", [(1, 3, 64), (2, 5, 96), (4, 2, 256), (8, 1, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_add_norm_is_the_rank_ordered_sum_then_the_add_rmsnorm_kernel(world: int, rows: int, n: int,
                                                                          dtype: torch.dtype) -> None:
    """The fused kernel gives the bits of the unfused path: the sum in rank order (as every rank computes it, so all
    ranks agree), then kernels/rms_norm.py's add+RMSNorm of it; without a norm weight, the sum alone."""
    from nvcli.kernels.allreduce_norm import sum_add_norm_triton
    from nvcli.kernels.rms_norm import rms_norm_triton

    parts = _parts(world, rows, n, dtype, seed=world * 100 + n)
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(rows, n, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    alone, same = on_device(sum_add_norm_triton)(parts, None, None)
    assert torch.equal(alone, same)
    total = _summed(parts)
    if dtype == torch.float32 or not INTERPRETED:
        assert torch.equal(alone, total)
    else:  # the interpreter's float32 -> bfloat16 cast does not round to nearest as torch's does
        assert torch.allclose(alone.float(), total.float(), rtol=2**-7, atol=0)
    out, new_res = on_device(sum_add_norm_triton)(parts, residual, weight, 1e-6)
    want_out, want_res = on_device(rms_norm_triton)(alone, weight, 1e-6, residual)
    assert torch.equal(new_res, want_res)
    assert torch.equal(out, want_out)
    out, new_res = on_device(sum_add_norm_triton)(parts, None, weight, 1e-6)  # no residual: the sum is the residual
    assert torch.equal(new_res, alone) and torch.equal(out, on_device(rms_norm_triton)(alone, weight, 1e-6)[0])


def test_no_rows_and_too_many_ranks() -> None:
    from nvcli.kernels.allreduce_norm import MAX_WORLD, sum_add_norm_triton

    out, _ = sum_add_norm_triton([torch.empty(0, 32)] * 2, None, None)
    assert out.shape == (0, 32)
    with pytest.raises(AssertionError, match="at most"):
        sum_add_norm_triton([torch.zeros(1, 32)] * (MAX_WORLD + 1), None, None)


@pytest.mark.parametrize("world, rows, n", [(1, 3, 64), (2, 5, 96), (4, 2, 256), (4, 9, 2000), (8, 17, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_two_shots_give_every_rank_the_one_shot_bits(world: int, rows: int, n: int, dtype: torch.dtype,
                                                     norm: bool) -> None:
    """Every rank's first shot over its own rows, then each rank's second: all ranks get the one-shot kernel's
    outputs bit for bit (fewer rows than ranks and rows that do not divide evenly included)."""
    from nvcli.kernels.allreduce_norm import (
        gather_add_norm_triton,
        reduce_owned_rows_triton,
        sum_add_norm_triton,
    )

    parts = _parts(world, rows, n, dtype, seed=world * 10 + rows)
    gen = torch.Generator().manual_seed(2)
    residual = torch.randn(rows, n, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype) if norm else None
    want = on_device(sum_add_norm_triton)(parts, residual, weight, 1e-6)
    buffers = [p.clone() for p in parts]  # the peer-mapped buffers, written in place by the first shot
    for rank in range(world):
        on_device(reduce_owned_rows_triton)(buffers, rank)
    got = on_device(gather_add_norm_triton)(buffers, residual, weight, 1e-6)  # the same call on every rank
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_owned_rows_cover_every_row_once() -> None:
    from nvcli.kernels.allreduce_norm import owned_rows

    for rows in (0, 1, 3, 4, 5, 64, 255, 2048):
        for world in (1, 2, 3, 4, 8):
            spans = [owned_rows(rows, world, r) for r in range(world)]
            covered = [i for lo, hi in spans for i in range(lo, hi)]
            assert covered == list(range(rows)), (rows, world, spans)
