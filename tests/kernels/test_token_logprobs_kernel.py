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

from nvcli.engine.sampler import TokenLogprobs
from nvcli.kernels.token_logprobs import _SLICE, logprob_and_rank_triton, top_width


def _columns(logits: torch.Tensor, targets: torch.Tensor, k: int = 0) -> tuple[torch.Tensor, ...]:
    """The kernels' packed rows as (token ids, chosen, ranks, top values, top ids), on the CPU."""
    packed = logprob_and_rank_triton(logits.to(DEVICE), targets.to(DEVICE), k)
    assert packed.shape == (logits.shape[0], 3 + 2 * k) and packed.dtype == torch.int32
    return TokenLogprobs(packed.cpu()).columns()


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
    ids, chosen, ranks, _, _ = _columns(logits, targets)
    assert chosen.dtype == torch.float32 and ranks.dtype == torch.int32 and torch.equal(ids.long(), targets)
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
    _, chosen, ranks, _, top_ids = _columns(logits, targets, 3)
    ref = torch.log_softmax(logits.double(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    assert torch.allclose(chosen.cpu().double(), ref, atol=1e-4, rtol=0)
    assert torch.equal(top_ids[0].long(), logits.topk(3).indices[0])
    empty = logprob_and_rank_triton(torch.zeros(0, 5000, device=DEVICE), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert empty.shape == (0, 3)


@pytest.mark.parametrize(("k", "dtype"), [(1, torch.float32), (5, torch.bfloat16), (20, torch.bfloat16)])
def test_top_k_equals_torch_topk_with_ties_broken_by_the_higher_id(k: int, dtype: torch.dtype) -> None:
    """prompt_logprobs=k / logprobs=k: each row's k most likely tokens come from the same read of the logits as the
    logprob (a torch.topk pass over a scoring job's logits took more time than the job)."""
    vocab = _SLICE + 123  # two slices, the last one short
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, vocab, generator=gen) * 4).to(dtype)  # [rows, vocab]
    logits[1, vocab - 1] = 50.0  # the top token in the short last slice
    logits[1, 3] = 49.0
    logits[2] = 1.0  # every token ties: the highest ids
    logits[3] = float("-inf")  # a constrained row: three tokens allowed, the rest read -inf
    logits[3, [10, _SLICE + 7, vocab - 2]] = torch.tensor([2.0, 3.0, 1.0], dtype=dtype)
    targets = torch.tensor([0, 3, 5, 10])
    # the interpreter runs the width-32 variant (k = 20) slowly: there only the rows whose answer depends on the
    # width (the ties and the constrained row); rows 0 and 1 test the slices, which every width reads alike
    rows = [2, 3] if k > 8 else [0, 1, 2, 3]
    _, chosen, _, values, ids = _columns(logits[rows], targets[rows], k)
    ids = ids.long()
    assert values.shape == ids.shape == (len(rows), k) and values.dtype == torch.float32
    at = {row: i for i, row in enumerate(rows)}  # row of `logits` -> row of the kernel's output
    ref = torch.log_softmax(logits.double(), dim=-1)  # [rows, vocab]
    for row in {0, 1} & set(rows):
        got_ids, got_values = ids[at[row]], values[at[row]]
        want = ref[row].topk(k)
        assert torch.allclose(got_values.double(), want.values, atol=1e-4, rtol=0), row
        assert torch.equal(ref[row, got_ids], ref[row].gather(0, got_ids)) and len(set(got_ids.tolist())) == k
        assert torch.allclose(ref[row, got_ids], want.values, atol=1e-6, rtol=0)  # each id holds its value
        for a, b in zip(got_ids.tolist(), got_ids[1:].tolist()):  # equal logits (bf16 has many): higher id first
            assert logits[row, a] > logits[row, b] or (logits[row, a] == logits[row, b] and a > b)
    if 1 in at:
        assert ids[at[1], 0].item() == vocab - 1 and (k == 1 or ids[at[1], 1].item() == 3)
    assert ids[at[2]].tolist() == list(range(vocab - 1, vocab - 1 - k, -1))
    allowed = [_SLICE + 7, 10, vocab - 2][:k]
    assert ids[at[3], : len(allowed)].tolist() == allowed
    # real ids, never padding
    assert bool((ids[at[3], 3:] < vocab).all()) and bool(torch.isinf(values[at[3], 3:]).all())
    assert bool(torch.isfinite(chosen).all())  # row 3's token is one of its three allowed


def test_top_width_is_the_narrowest_variant_that_holds_k() -> None:
    assert [top_width(k) for k in (0, 1, 2, 3, 5, 8, 9, 20, 32)] == [0, 1, 8, 8, 8, 8, 32, 32, 32]


SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nvcli.kernels import token_logprobs as m

    for kernel in (m._logprob_partials_kernel, m._logprob_finish_kernel):
        for logits in ("*bf16", "*fp32"):
            for width in m.TOP_WIDTHS:
                types = {"logits_ptr": logits, "targets_ptr": "*i64", "max_ptr": "*fp32", "sum_ptr": "*fp32",
                         "count_ptr": "*i32", "top_ptr": "*i64", "out_ptr": "*i32", "stride_logits": "i32",
                         "stride_out": "i32", "vocab": "i32", "slices": "i32", "runs": "i32", "k": "i32",
                         "BLOCK": "constexpr", "SLICE": "constexpr", "SLICES": "constexpr", "RUN": "constexpr",
                         "RUNS": "constexpr", "SORT": "constexpr", "TOPK": "constexpr"}
                sig = {n: types[n] for n in kernel.arg_names}
                run = m._RUN[width]
                values = {"BLOCK": m._BLOCK, "SLICE": m._SLICE, "SLICES": 16, "RUN": run,
                          "RUNS": triton.cdiv(10 * m._SLICE // run, m._SORT) * m._SORT, "SORT": m._SORT, "TOPK": width}
                consts = {(kernel.arg_names.index(n),): v for n, v in values.items() if n in kernel.arg_names}
                triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    print("compiled")
""")


def test_kernel_compiles_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3]])  # every row (the logits read in place) and a subset (gathered)
def test_the_kernel_path_gives_the_torch_path_s_logprobs(rows: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's entry points on the kernel path (one packed tensor, written chunk by chunk; the sampled tokens'
    logprobs without a gathered copy when every row asks) give what their torch path gives."""
    from nvcli.engine import sampler

    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, 3000, generator=gen) * 3).to(DEVICE)  # [rows, vocab]
    tokens = torch.tensor([5, 17, 2999, 0], device=DEVICE)
    ks = [2, 0, 5, 1][: len(rows)]
    want = sampler.sampled_token_logprobs(logits.cpu(), tokens.cpu(), rows, ks).flat(ks)
    want_prompt = sampler.token_logprobs([logits.cpu()[:3], logits.cpu()[3:]], tokens.cpu(), 1, torch.device("cpu"))
    monkeypatch.setattr(sampler, "use_triton", lambda t: True)  # the kernels, on the GPU or through the interpreter
    got = sampler.sampled_token_logprobs(logits, tokens, rows, ks).flat(ks)
    got_prompt = sampler.token_logprobs([logits[:3], logits[3:]], tokens, 1, logits.device)  # two chunks, one tensor
    assert got.starts == want.starts and got.token_ids == want.token_ids and got.ranks == want.ranks
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    flat, flat_want = got_prompt.flat([1, 1, 0, 1]), want_prompt.flat([1, 1, 0, 1])
    assert flat.starts == flat_want.starts and flat.token_ids == flat_want.token_ids and flat.ranks == flat_want.ranks
    assert flat.logprobs == pytest.approx(flat_want.logprobs, abs=1e-4)
