"""engine/sampler.py on CPU: the filters keep exactly the tokens vLLM's would, whatever the values."""

from __future__ import annotations

import torch

from nvcli.engine.sampler import SamplingBatch, sample
from nvcli.sampling_params import SamplingParams

# token 3: p=0.5, token 7: 0.3, token 1: 0.15, every other token of the 16 shares 0.05
PROBS = torch.full((16,), 0.05 / 13)
PROBS[3], PROBS[7], PROBS[1] = 0.5, 0.3, 0.15
LOGITS = PROBS.log()


def draws(n: int = 400, temperature: float = 1.0, **params) -> set[int]:
    """The tokens drawn for n rows of LOGITS, each with its own seed."""
    sp = [SamplingParams(temperature=temperature, seed=i, **params) for i in range(n)]
    batch = SamplingBatch.build(sp, [0] * n, LOGITS.numel(), torch.device("cpu"))
    return set(sample(LOGITS.repeat(n, 1), batch).tolist())


def test_no_filter_draws_the_tail_too() -> None:
    assert {3, 7, 1} < draws()


def test_top_k_keeps_the_k_most_likely() -> None:
    assert draws(top_k=1) == {3}
    assert draws(top_k=2) == {3, 7}


def test_top_k_keeps_the_tokens_tied_with_its_last() -> None:
    """13 tokens tie for 4th place: each stays (vLLM's top-k-only path keeps ties too); a sort kept one at random."""
    drawn = draws(top_k=4)
    assert {3, 7, 1} < drawn and len(drawn) > 4


def test_a_top_k_past_the_vocabulary_is_no_filter() -> None:
    """A huge top_k is valid (vLLM treats it as off); it used to overflow building the int64 tensor and end the job."""
    assert {3, 7, 1} < draws(top_k=2**70)


def test_top_p_keeps_the_nucleus() -> None:
    assert draws(top_p=0.75) == {3, 7}  # 0.5 before 7 is < 0.75; 0.8 before 1 is not
    assert draws(top_p=0.5) == {3}


def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token() -> None:
    """top_p=1e-300 is 0 in float32: every token used to be masked, and token 0 was drawn."""
    assert draws(top_p=1e-300) == {3}


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    assert draws(min_p=0.5) == {3, 7}  # 0.3 >= 0.25, 0.15 < 0.25
    assert draws(min_p=1.0) == {3}


def test_a_temperature_below_1e_5_is_greedy() -> None:
    """vLLM treats it as greedy; dividing the logits by 1e-40 overflowed to NaN and drew token 0."""
    assert draws(n=50, temperature=1e-40) == {3}


def test_stop_set_after_construction_is_read() -> None:
    sp = SamplingParams(max_tokens=4)
    sp.stop = ["x"]
    assert sp.stop_list == ["x"]
    sp.stop = "y"
    assert sp.stop_list == ["y"]
