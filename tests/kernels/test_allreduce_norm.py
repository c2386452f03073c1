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
    _same_norm(out, want_out)
    out, new_res = on_device(sum_add_norm_triton)(parts, None, weight, 1e-6)  # no residual: the sum is the residual
    assert torch.equal(new_res, alone)
    _same_norm(out, on_device(rms_norm_triton)(alone, weight, 1e-6)[0])


def _same_norm(got: torch.Tensor, want: torch.Tensor) -> None:
    """The two kernels' normed rows: the same bits, but for float32 on a GPU, where the two kernels' row layouts sum
    the squares in different orders (1 / RMS within a float32 ulp or two); every rank runs the same kernel, so the
    ranks still agree bit for bit."""
    if got.dtype == torch.float32 and not INTERPRETED:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


def test_no_rows_and_too_many_ranks() -> None:
    from nvcli.kernels.allreduce_norm import MAX_WORLD, sum_add_norm_triton

    out, _ = sum_add_norm_triton([torch.empty(0, 32)] * 2, None, None)
    assert out.shape == (0, 32)
    with pytest.raises(AssertionError, match="at most"):
        sum_add_norm_triton([torch.zeros(1, 32)] * (MAX_WORLD + 1), None, None)
