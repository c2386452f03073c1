"""kernels/sampling_filters.py: the floor search finds exactly the floor a sort gives, in every dtype a sampler meets,
and the floor keeps what vLLM's filters keep."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_device import DEVICE

from nvcli.kernels.sampling_filters import CAPACITY, filter_floors_reference, filter_floors_triton

ROWS = [  # temperature, top_k (0 = off), top_p, min_p
    (0.6, 20, 0.95, 0.0),  # Qwen3's generation_config
    (1.0, 0, 0.9, 0.0),
    (0.0, 5, 0.5, 0.1),  # greedy: keeps every token, whatever its filters say
    (0.7, 50, 1.0, 0.1),
    (1.3, 1, 0.5, 0.0),
    (0.5, 0, 0.3, 0.0),
    (0.8, 0, 1.0, 0.05),
    (1.0, 0, 1.0, 0.0),  # no filter on this row (its neighbours have some)
    (0.9, 7, 1e-30, 0.0),  # a top_p that is 0 in float32: the most likely token alone
    (1.1, 3000, 0.99, 0.0),  # top_k at the vocabulary: off
    (1.0, 2500, 0.9, 0.0),  # top_k above the lanes the kernel bounds it with
    (0.3, 64, 0.999, 0.02),
    (1.0, 20, 1.0, 0.0),  # top-k alone
    (2.0, 30, 0.999, 0.0),  # top-k binding before top-p
]


def floors(logits: torch.Tensor, rows: list[tuple[float, int, float, float]], kernel: bool,
           capacity: int = CAPACITY) -> torch.Tensor:
    vocab = logits.shape[1]
    temps = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    top_k = torch.tensor([min(r[1], vocab) if r[1] > 0 else vocab for r in rows], dtype=torch.int64)
    top_p = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    min_p = torch.tensor([r[3] for r in rows], dtype=torch.float32)
    if not kernel:
        return filter_floors_reference(logits, temps, top_k, top_p, min_p)
    args = [t.to(DEVICE) for t in (logits, temps, top_k, top_p, min_p)]
    return filter_floors_triton(*args, capacity=capacity).cpu()


# The kernel copies a row's candidates to a scratch of `capacity` values once they fit; a row whose candidates do not
# fit is searched over the whole row. Small capacities take the second path for some rows, or for all of them.
@pytest.mark.parametrize("capacity", [CAPACITY, 64, 16, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_search_finds_the_floor_a_sort_gives(dtype: torch.dtype, capacity: int) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(len(ROWS), 3000) * 3).to(dtype)  # bf16 rounding makes ties, at the boundaries too
    logits[1, :40] = float("-inf")  # banned tokens (min_tokens, a grammar's mask)
    logits[3, 100:110] = logits[3].max()  # ten tokens tied for the top
    logits[4, 2000:2100] = logits[4].max()  # more ties at the top than a small scratch holds
    found = floors(logits, ROWS, kernel=True, capacity=capacity)
    assert torch.equal(found, floors(logits, ROWS, kernel=False)), found
    assert found[2] == -math.inf and found[7] == logits[7].float().min()  # greedy keeps all; no filter keeps all
    assert found[8] == logits[8].float().max()


def test_a_row_of_equal_logits_and_one_of_few_finite_ones() -> None:
    logits = torch.zeros(2, 700)
    logits[1] = float("-inf")
    logits[1, [3, 500]] = torch.tensor([1.0, 2.0])
    rows = [(1.0, 20, 0.5, 0.0), (1.0, 20, 0.9, 0.0)]
    found = floors(logits, rows, kernel=True)
    assert torch.equal(found, floors(logits, rows, kernel=False))
    assert found[0] == 0.0  # every token ties with the 20th: all stay
    assert found[1] == 1.0  # 2.0 holds 73% of the mass, so top_p 0.9 needs 1.0 as well; top_k 20 keeps -inf ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nucleus_that_needs_nearly_the_whole_row(dtype: torch.dtype) -> None:
    # The kernel narrows top-p's search to the tokens above top + T (ln((1 - p) kept_mass / vocab) - 0.05), a bound
    # that is nearly tight here: 999 tied tokens hold 91% of the mass, and top_p 0.095 needs them.
    logits = torch.full((1, 1000), math.log(0.01)).to(dtype)
    logits[0, 500] = 0.0
    found = floors(logits, [(1.0, 0, 0.095, 0.0)], kernel=True)
    assert torch.equal(found, floors(logits, [(1.0, 0, 0.095, 0.0)], kernel=False))
    assert found[0] == logits[0, 0].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidates_crowded_into_one_lane(dtype: torch.dtype) -> None:
    # The compaction keeps each lane's candidates three at a time in registers (column c is lane c % 2048), a pass over
    # the row per three, and stores them as it reads the row once more where a lane has more than 9: row 0 has 10 of
    # its top tokens in lane 7, row 1 has 5 in lane 7 and 5 in lane 9, tied with lane 7's third.
    torch.manual_seed(2)
    logits = torch.randn(2, 20_000).to(dtype)
    logits[0, 7::2048] = torch.arange(14.0, 9.0, -0.5).to(dtype)
    logits[1, 7:10_000:2048] = torch.tensor([9.0, 8.5, 8.0, 7.5, 7.0]).to(dtype)
    logits[1, 9:10_000:2048] = 8.0
    rows = [(1.0, 4, 0.999, 0.0), (0.7, 9, 1.0, 0.0)]
    found = floors(logits, rows, kernel=True)
    assert torch.equal(found, floors(logits, rows, kernel=False))
    assert found[0] == 12.5 and found[1] == 7.5  # the 9th largest: lane 7's fourth


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lanes_fourth_value_at_the_bound_is_a_candidate(dtype: torch.dtype) -> None:
    # Where no lane's fourth largest value reaches the bound, the candidates are the lanes' three largest, kept in
    # registers by the first pass; a fourth equal to the bound is one too. Lane 7 holds 10, 9, 8 and 4, lanes 8-10
    # hold 4: top_k 4's bound is 4 (the 4th largest lane maximum) and so is its floor (four 4s tie), and top_p 0.9943
    # of that set's mass needs lane 7's 4 as well (without it, 10, 9 and 8 would hold enough and the floor would be 8).
    # Row 1: lane 7 holds three of top_k 2's candidates (10, 9, 8), all from the registers; its floor is 9.
    logits = torch.full((2, 10_000), -30.0)
    logits[0, [7, 7 + 2048, 7 + 4096, 7 + 6144]] = torch.tensor([10.0, 9.0, 8.0, 4.0])
    logits[1, [7, 7 + 2048, 7 + 4096]] = torch.tensor([10.0, 9.0, 8.0])
    logits[:, 8:11] = 4.0
    rows = [(1.0, 4, 0.9943, 0.0), (1.0, 2, 1.0, 0.0)]
    found = floors(logits.to(dtype), rows, kernel=True)
    assert torch.equal(found, floors(logits.to(dtype), rows, kernel=False))
    assert found.tolist() == [4.0, 9.0]


def kept(row: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> set[int]:
    x = torch.tensor([row])
    floor = floors(x, [(temperature, top_k, top_p, min_p)], kernel=True)
    return {i for i, v in enumerate(row) if v >= floor[0]}


def test_the_floor_keeps_what_the_filters_keep() -> None:
    probs = [0.05, 0.15, 0.3, 0.5]
    row = [math.log(p) for p in probs]
    assert kept(row, top_k=2) == {2, 3}
    assert kept(row, top_p=0.75) == {2, 3}  # 0.5 before token 2 is below 0.75; 0.8 before token 1 is not
    assert kept(row, top_p=0.81) == {1, 2, 3}
    assert kept(row, top_k=3, top_p=0.6) == {2, 3}  # renormalized over the top 3: 0.5 / 0.95 = 0.53 < 0.6
    assert kept(row, min_p=0.5) == {2, 3}  # 0.3 >= 0.25 > 0.15
    assert kept(row, temperature=0.5, min_p=0.5) == {3}  # tempered: (0.3 / 0.5)^2 = 0.36 < 0.5
    assert kept(row, temperature=3.0, top_p=0.75) == {1, 2, 3}  # flatter: the top two hold less than 0.75
    assert kept([1.0, 3.0, 3.0, 2.0], top_k=1) == {1, 2}  # ties with the last kept token stay


def test_bf16_logits_and_their_float32_copy_get_the_same_floor() -> None:
    # A step with a penalized or biased row samples from a float32 copy of its logits; the other rows must keep the
    # floor they get from the model's bf16 logits, or a seeded request's tokens would depend on its neighbours.
    torch.manual_seed(1)
    rows = [(1.0, 50, 1.0, 0.0), (0.6, 20, 0.95, 0.0), (0.8, 0, 0.9, 0.0), (1.0, 0, 0.5, 0.0), (0.7, 0, 1.0, 0.05)]
    # 40,000 columns: many loads of every pass (a 151,936-wide vocabulary behaves alike, at 4x the interpreter's time)
    # and bf16 ties among them
    logits = (torch.randn(len(rows), 40_000) * 2).to(torch.bfloat16)
    found = floors(logits, rows, kernel=True)
    assert torch.equal(found, floors(logits.float(), rows, kernel=True))
    assert torch.equal(found, floors(logits, rows, kernel=False))
