"""kernels/penalties.py: the one-pass penalty kernel equals the torch form (engine/penalties.apply_penalties) bit for
bit, on the GPU or through the Triton interpreter; and it compiles for the H100 on any machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_device import DEVICE

from nvcli.engine.penalties import PenaltyBatch, apply_penalties
from nvcli.kernels.penalties import apply_penalties_triton

VOCAB = 5000  # not a multiple of the kernel's block: the last chunk is masked


def _history(num_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, 4, (num_slots, VOCAB), generator=gen, dtype=torch.int32)
    counts *= torch.rand(num_slots, VOCAB, generator=gen) < 0.05  # most tokens unseen
    seen = (counts > 0) | (torch.rand(num_slots, VOCAB, generator=gen) < 0.02)  # output | prompt
    return counts, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["all", "repetition", "counts", "frequency"])
@pytest.mark.parametrize("all_rows", [False, True])
def test_kernel_equals_the_torch_form_bit_for_bit(dtype: torch.dtype, which: str, all_rows: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, VOCAB, generator=gen) * 4).to(dtype)  # [num_seqs, vocab]
    logits[0, :3] = torch.tensor([0.0, float("-inf"), -0.0]).to(dtype)
    counts, seen = _history(6, gen)
    rows = torch.arange(5) if all_rows else torch.tensor([0, 2, 3])
    slots = torch.tensor([4, 0, 5, 2, 1])[: len(rows)]
    n = len(rows)
    presence = torch.tensor([0.5, -1.25, 2.0, 0.1, 0.0])[:n]
    frequency = torch.tensor([0.2, 1.7, -0.3, 0.0, 0.9])[:n]
    repetition = torch.tensor([1.3, 0.7, 1.05, 2.0, 1.0])[:n]
    pb = PenaltyBatch(rows=rows, slots=slots, presence=presence if which in ("all", "counts") else None,
                      frequency=frequency if which in ("all", "counts", "frequency") else None,
                      repetition=repetition if which in ("all", "repetition") else None,
                      counts=counts, seen=seen if which in ("all", "repetition") else None, all_rows=all_rows)
    want = apply_penalties(logits, pb)  # the torch form (CPU tensors)
    out = logits.to(DEVICE).to(torch.float32, copy=True)
    if all_rows:
        out.fill_(float("nan"))  # every row must be written
    d = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    apply_penalties_triton(logits.to(DEVICE), out, d(rows), d(slots), d(counts), d(pb.seen), d(pb.presence),
                           d(pb.frequency), d(pb.repetition))
    assert torch.equal(out.cpu(), want), (out.cpu() - want).abs().max()


def test_kernel_reads_a_verify_steps_step_local_history_rows() -> None:
    """A step with verify rows (speculative decoding) passes the kernel step-local history rows (slots 0 .. P - 1,
    PenaltySlots._verify_batch) for rows of any order: the same numbers as the torch form."""
    from nvcli.engine.penalties import PenaltySlots
    from nvcli.engine.scheduler import PENDING
    from nvcli.engine.sequence import Sequence
    from nvcli.sampling_params import SamplingParams

    seqs = [Sequence([1, 2, 3], SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), block_size=16),
            Sequence([4, 5], SamplingParams(), block_size=16),
            Sequence([6], SamplingParams(presence_penalty=0.7), block_size=16)]
    for seq, tail in zip(seqs, ([7, 8, 9, 7], [1, 2], [9])):
        seq.token_ids += [*tail, PENDING]
    pb = PenaltySlots(torch.device("cpu")).prepare(seqs, [7, 4, 2], VOCAB, [3, 2, 0])  # 3 + 5 rows; 3 + 2 drafts
    assert pb is not None and pb.verify is not None and pb.seen is not None and not pb.all_rows
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(2)).bfloat16()
    want = apply_penalties(logits, pb)
    out = logits.to(DEVICE).to(torch.float32, copy=True)
    d = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    apply_penalties_triton(logits.to(DEVICE), out, d(pb.rows), d(pb.slots), d(pb.counts), d(pb.seen),
                           d(pb.presence), d(pb.frequency), d(pb.repetition))
    assert torch.equal(out.cpu(), want), (out.cpu() - want).abs().max()


SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nvcli.kernels import penalties

    kernel = penalties._apply_penalties_kernel
    for logits in ("*bf16", "*fp32"):
        types = {"logits_ptr": logits, "out_ptr": "*fp32", "rows_ptr": "*i64", "slots_ptr": "*i64",
                 "counts_ptr": "*i32", "seen_ptr": "*u8", "presence_ptr": "*fp32", "frequency_ptr": "*fp32",
                 "repetition_ptr": "*fp32", "stride_logits": "i32", "stride_out": "i32", "vocab": "i32",
                 "use_repetition": "i32", "use_counts": "i32", "BLOCK": "constexpr"}
        sig = {n: types[n] for n in kernel.arg_names}
        src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index("BLOCK"),): penalties._BLOCK})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, enable_fp_fusion=False))
    print("compiled")
""")


def test_kernel_compiles_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_every_mix_of_penalties_launches_the_same_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """A None argument is a constexpr to Triton: a variant of its own, compiled at a job's first step with that mix
    (start-up warms up one). Every mix must pass a tensor for every pointer."""
    from nvcli.kernels import penalties

    seen_signatures = set()

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen_signatures.add(tuple(type(a).__name__ if not isinstance(a, torch.Tensor) else str(a.dtype)
                                          for a in args))
            return launch

    monkeypatch.setattr(penalties, "_apply_penalties_kernel", Recorder())
    logits = torch.zeros(2, 64)
    counts = torch.zeros(2, 64, dtype=torch.int32)
    f = torch.ones(2)
    for presence in (None, f):
        for frequency in (None, f):
            for repetition in (None, f):
                seen = counts.bool() if repetition is not None else None
                apply_penalties_triton(logits, logits.clone(), torch.arange(2), torch.arange(2), counts, seen,
                                       presence, frequency, repetition)
    assert len(seen_signatures) == 1, seen_signatures
    assert "NoneType" not in next(iter(seen_signatures))
