"""Two-batch overlap (engine/overlap.py): a decode step run as two halves gives the whole step's result,
and the halves' stages are issued so that one half's attention can run beside the other's GEMMs."""

from __future__ import annotations

import pytest
import torch

from nvcli import LLM
from nvcli.engine.attention_metadata import AttentionMetadata
from nvcli.engine.model_runner import StepInput
from nvcli.engine.overlap import DecodeOverlap, decode_rows

PROMPT_LENS = [5, 17, 33, 40, 9]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def runner(request, tiny_model_dir):
    llm = LLM(str(tiny_model_dir(request.param)), device="cpu", max_model_len=256, num_kvcache_blocks=64)
    runner = llm.engine.executor.runner
    # the prompts' KV in the cache: sequence i owns blocks [4i, 4i + 4) of 16 tokens
    blocks = [list(range(4 * i, 4 * i + 4)) for i in range(len(PROMPT_LENS))]
    qsl = [0]
    for n in PROMPT_LENS:
        qsl.append(qsl[-1] + n)
    ids = [(7 * i + 3 * p) % 500 for i, n in enumerate(PROMPT_LENS) for p in range(n)]
    positions = [p for n in PROMPT_LENS for p in range(n)]
    slots = [b[p // 16] * 16 + p % 16 for b, n in zip(blocks, PROMPT_LENS) for p in range(n)]
    runner._forward(StepInput(ids, positions, slots, qsl, PROMPT_LENS, blocks, False))
    yield runner, blocks
    llm.shutdown()


def _decode_step(blocks: list[list[int]]) -> StepInput:
    ids = [11 + 13 * i for i in range(len(PROMPT_LENS))]
    slots = [b[n // 16] * 16 + n % 16 for b, n in zip(blocks, PROMPT_LENS)]
    return StepInput(ids, list(PROMPT_LENS), slots, list(range(len(PROMPT_LENS) + 1)),
                     [n + 1 for n in PROMPT_LENS], blocks, True)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_halves_equal_the_whole_step(runner, split: int) -> None:
    """Each row of a decode step run as two halves (uneven ones too) gets the hidden state and residual
    that the whole step gives it: every half reads its own rows' KV and writes its own new tokens."""
    runner, blocks = runner
    step = _decode_step(blocks)
    want_hidden, want_residual = runner._forward(step)
    input_ids, positions, meta = runner._tensors(step)
    with torch.inference_mode():
        hidden, residual = DecodeOverlap(torch.device("cpu")).forward(runner.model, input_ids, positions, meta, split)
    torch.testing.assert_close(hidden, want_hidden)
    torch.testing.assert_close(residual, want_residual)
    # the rows differ from each other, so a half reading the other half's rows or KV could not pass
    assert not torch.allclose(want_hidden[0], want_hidden[-1])


def test_split_must_leave_rows_in_both_halves(runner) -> None:
    runner, blocks = runner
    input_ids, positions, meta = runner._tensors(_decode_step(blocks))
    for split in (0, len(PROMPT_LENS)):
        with pytest.raises(ValueError, match="both halves"):
            DecodeOverlap(torch.device("cpu")).forward(runner.model, input_ids, positions, meta, split)


def test_decode_rows_rejects_prefill_steps() -> None:
    meta = AttentionMetadata(torch.zeros(4, dtype=torch.int64), torch.tensor([0, 3, 4], dtype=torch.int32),
                             torch.tensor([3, 1], dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 3, 3, False)
    with pytest.raises(ValueError, match="decode steps"):
        decode_rows(meta, 0, 1)


class _RecordingModel:
    """Three layers whose stages only log when they are issued."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def forward_stages(self, input_ids, positions, meta):
        half = "AB"[int(input_ids[0])]
        x = input_ids.float()
        for layer in range(3):
            self.log.append(f"{half}{layer} before")
            yield x
            self.log.append(f"{half}{layer} attention")
            yield x
            self.log.append(f"{half}{layer} after")
        return x + 1, x


def test_attention_of_one_half_is_issued_between_the_other_halves_stages() -> None:
    """The order that makes the overlap: A's attention, then B's up to its attention, then B's attention,
    then A's rest of the layer and next layer up to attention (which runs beside B's attention), ..."""
    model = _RecordingModel()
    ids = torch.tensor([0, 0, 1, 1, 1])
    meta = AttentionMetadata(torch.zeros(5, dtype=torch.int64), torch.arange(6, dtype=torch.int32),
                             torch.ones(5, dtype=torch.int32), torch.zeros(5, 1, dtype=torch.int32), 1, 1, True)
    hidden, residual = DecodeOverlap(torch.device("cpu")).forward(model, ids, ids, meta, 2)
    assert hidden.tolist() == [1, 1, 2, 2, 2] and residual.tolist() == [0, 0, 1, 1, 1]
    assert model.log == [
        "A0 before", "A0 attention", "B0 before", "B0 attention",
        "A0 after", "A1 before", "A1 attention", "B0 after", "B1 before", "B1 attention",
        "A1 after", "A2 before", "A2 attention", "B1 after", "B2 before", "B2 attention",
        "A2 after", "B2 after",
    ]
