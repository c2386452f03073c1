"""kernels/token_logprobs.py: the one-read logprob-and-rank kernel equals a float64 log-softmax, on the GPU or through
the Triton interpreter, and compiles for the H100 on any machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_device import DEVICE

from nvcli.kernels.token_logprobs import _SLICE, logprob_and_rank_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5000, 2 * _SLICE + 123])  # one slice, masked; three slices, the last one short
def test_logprob_and_rank_equal_a_float64_log_softmax(dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, vocab, generator=gen) * 5).to(dtype)  # [rows, vocab]
    logits[1, 7] = 60.0  # one dominant logit: the merge of slices must carry its max
    logits[2] = logits[2, 0]  # a flat row: every token ties, rank 1, log(1 / vocab)
    targets = torch.tensor([0, 7, 3, vocab - 1, 11, vocab // 2])
    ref = torch.log_softmax(logits.double(), dim=-1)
    want = ref.gather(1, targets.unsqueeze(1)).squeeze(1)
    want_rank = (logits.float() > logits.float().gather(1, targets.unsqueeze(1))).sum(dim=1) + 1
    chosen, ranks, lse = logprob_and_rank_triton(logits.to(DEVICE), targets.to(DEVICE))
    assert chosen.dtype == torch.float32 and ranks.dtype == torch.int32 and lse.shape == (6, 1)
    assert torch.allclose(chosen.cpu().double(), want, atol=1e-4, rtol=0), (chosen.cpu().double() - want).abs().max()
    assert torch.equal(ranks.cpu().long(), want_rank)
    assert ranks[2].item() == 1 and chosen[2].item() == pytest.approx(-torch.log(torch.tensor(float(vocab))).item(),
                                                                       abs=1e-4)


def test_rows_of_a_wider_tensor_and_no_rows() -> None:
    """The LM head's logits may be a column slice of a padded vocabulary: rows are read at their stride."""
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(3, 5100, generator=gen)
    logits = wide[:, :5000]
    targets = torch.tensor([4, 4999, 0])
    chosen, ranks, _ = logprob_and_rank_triton(logits.to(DEVICE), targets.to(DEVICE))
    ref = torch.log_softmax(logits.double(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    assert torch.allclose(chosen.cpu().double(), ref, atol=1e-4, rtol=0)
    empty = logprob_and_rank_triton(torch.zeros(0, 5000, device=DEVICE), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert [t.shape[0] for t in empty] == [0, 0, 0]


SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nvcli.kernels import token_logprobs as m

    kernel = m._logprob_partials_kernel
    for logits in ("*bf16", "*fp32"):
        types = {"logits_ptr": logits, "targets_ptr": "*i64", "max_ptr": "*fp32", "sum_ptr": "*fp32",
                 "count_ptr": "*i32", "stride_logits": "i32", "vocab": "i32", "slices": "i32",
                 "BLOCK": "constexpr", "SLICE": "constexpr"}
        sig = {n: types[n] for n in kernel.arg_names}
        consts = {(kernel.arg_names.index("BLOCK"),): m._BLOCK, (kernel.arg_names.index("SLICE"),): m._SLICE}
        triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    print("compiled")
""")


def test_kernel_compiles_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
