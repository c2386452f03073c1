"""Structured outputs' token mask on the logits: -inf wherever a row's bitmask has a 0 bit.

The mask comes from the grammar matchers (engine/structured_output.py) as int32 words, bit j of word w standing for
token 32 * w + j (llguidance's layout). Only the constrained rows of a step have a mask, so the kernel takes their
row indices; each program masks BLOCK columns of one row in place, in the logits' own dtype (the sampler and the
logprobs then read the constrained distribution, as vLLM's do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvcli.kernels.ops import use_triton

_BLOCK = 4096


# rows_ptr / mask_ptr come from one upload at offsets that vary with the row count: no variant per alignment
@triton.jit(do_not_specialize=["rows_ptr", "mask_ptr"])
def _apply_token_bitmask_kernel(
    logits_ptr,  # [num_seqs, vocab], any float dtype, written in place
    rows_ptr,  # [num_masked] int64: the logits row of each mask row
    mask_ptr,  # [num_masked, words] int32
    stride_logits,
    vocab,
    words,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = tl.load(mask_ptr + i.to(tl.int64) * words + cols // 32, mask=in_vocab, other=0)
    banned = ((word >> (cols % 32)) & 1) == 0
    row = tl.load(rows_ptr + i)
    x_ptr = logits_ptr + row * stride_logits + cols
    minus_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(x_ptr, minus_inf, mask=in_vocab & banned)


def apply_token_bitmask_ref(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """The torch form: unpack each mask row's bits and fill the banned logits with -inf."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1  # [num_masked, words, 32]
    allowed = bits.reshape(mask.shape[0], -1)[:, :vocab].bool()  # [num_masked, vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """logits [num_seqs, vocab] (row-contiguous), rows [num_masked] int64, mask [num_masked, ceil(vocab / 32)] int32,
    all on one device: set logits[rows[i], t] = -inf wherever bit t of mask[i] is 0."""
    assert mask.shape[1] * 32 >= logits.shape[1], "the mask must cover the vocabulary"
    if use_triton(logits):
        apply_token_bitmask_triton(logits, rows, mask)
    else:
        apply_token_bitmask_ref(logits, rows, mask)


def apply_token_bitmask_triton(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    assert logits.stride(1) == 1, "the kernel writes each row as one contiguous run"
    if mask.shape[0]:
        grid = (mask.shape[0], triton.cdiv(logits.shape[1], _BLOCK))
        _apply_token_bitmask_kernel[grid](logits, rows, mask, logits.stride(0), logits.shape[1], mask.shape[1],
                                          BLOCK=_BLOCK)
