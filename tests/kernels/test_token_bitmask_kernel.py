"""kernels/token_bitmask.py: the structured-output mask sets exactly the banned logits of the masked rows to -inf, on
the GPU or through the Triton interpreter (its sm_90 compile is in test_compile_for_hopper.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from nvcli.kernels.token_bitmask import _BLOCK, apply_token_bitmask_ref, apply_token_bitmask_triton


def test_the_reference_reads_llguidance_bit_order() -> None:
    """Bit j of word w is token 32 * w + j."""
    logits = torch.zeros(2, 40)
    mask = torch.tensor([[0b1011, 1 << 7]], dtype=torch.int32)  # tokens 0, 1, 3 and 32 + 7
    apply_token_bitmask_ref(logits, torch.tensor([0]), mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 1, 3, 39]
    assert torch.isfinite(logits[1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [100, _BLOCK + 33])  # a partial last word; two column blocks
def test_kernel_equals_the_reference(dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)  # [rows, vocab]
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[1] = -1  # every token allowed
    mask[2] = 0
    mask[2, 0] = 1 << 5  # token 5 alone
    rows = torch.tensor([4, 0, 2])
    want = logits.clone()
    apply_token_bitmask_ref(want, rows, mask)
    got = logits.to(DEVICE)
    apply_token_bitmask_triton(got, rows.to(DEVICE), mask.to(DEVICE))
    got = got.cpu()
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])  # rows without a mask are untouched
    assert torch.equal(got[0], logits[0])  # an all-ones mask bans nothing
    assert torch.isfinite(got[2]).tolist() == [t == 5 for t in range(vocab)]
    assert (~torch.isfinite(got[4])).sum().item() > vocab // 4  # a random mask bans about half


def test_a_row_slice_of_wider_logits_and_no_rows() -> None:
    wide = torch.randn(2, 160)
    logits = wide[:, :150].to(DEVICE)  # the LM head of a padded vocabulary: rows at a stride of 160
    mask = torch.zeros(1, 5, dtype=torch.int32)
    apply_token_bitmask_triton(logits, torch.tensor([1], device=DEVICE), mask.to(DEVICE))
    assert torch.isinf(logits[1].cpu()).all() and torch.isfinite(logits[0].cpu()).all()
    apply_token_bitmask_triton(logits, torch.zeros(0, dtype=torch.int64, device=DEVICE),
                               torch.zeros(0, 5, dtype=torch.int32, device=DEVICE))

