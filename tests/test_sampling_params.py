"""SamplingParams validation at construction: logit_bias."""

from __future__ import annotations

import dataclasses

import pytest

from nvcli import SamplingParams


def test_logit_bias_is_a_plain_dict_of_int_to_float_clamped_to_100() -> None:
    """vLLM clamps to [-100, 100] (SamplingParams.from_optional, OpenAI's range) rather than refusing."""
    given = {5: 1, 7: -300, 9: 10**400, 3: 2.5, 0: 100, 11: -100.0}
    sp = SamplingParams(logit_bias=given)
    assert sp.logit_bias == {5: 1.0, 7: -100.0, 9: 100.0, 3: 2.5, 0: 100.0, 11: -100.0}
    assert all(type(t) is int and type(b) is float for t, b in sp.logit_bias.items())
    assert sp.logit_bias is not given and given[7] == -300  # the caller's dict is left alone
    assert sp.has_logit_bias


@pytest.mark.parametrize("value", [None, {}])
def test_no_logit_bias(value) -> None:
    sp = SamplingParams(logit_bias=value)
    assert sp.logit_bias == value and not sp.has_logit_bias


@pytest.mark.parametrize("value, why", [
    ({-1: 1.0}, "keys must be non-negative integer token ids"),
    ({True: 1.0}, "keys must be non-negative integer token ids"),
    ({"5": 1.0}, "keys must be non-negative integer token ids"),  # the job reader converts JSON's string keys
    ({1.0: 1.0}, "keys must be non-negative integer token ids"),
    ({1: float("nan")}, "values must be finite numbers"),
    ({1: float("inf")}, "values must be finite numbers"),
    ({1: -float("inf")}, "values must be finite numbers"),
    ({1: True}, "values must be finite numbers"),
    ({1: "1"}, "values must be finite numbers"),
    ({1: None}, "values must be finite numbers"),
    ([[1, 1.0]], "must be a dict"),
    ("{1: 1}", "must be a dict"),
])
def test_bad_logit_bias_is_refused_naming_the_field(value, why: str) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.logit_bias: {why}"):
        SamplingParams(logit_bias=value)


def test_each_completion_of_n_gets_its_own_copy_of_the_bias() -> None:
    """n > 1: the engine makes one SamplingParams per completion with dataclasses.replace (validated again)."""
    sp = SamplingParams(n=2, logit_bias={4: 1.5})
    child = dataclasses.replace(sp, n=1)
    assert child.logit_bias == {4: 1.5} and child.logit_bias is not sp.logit_bias


@pytest.mark.parametrize("value", [0, -2, True, 2.5, "8"])
def test_truncate_prompt_tokens_is_a_positive_count_or_minus_one(value) -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    assert SamplingParams(truncate_prompt_tokens=8).truncate_prompt_tokens == 8


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("seed", "x"), ("logprobs", 21), ("logit_bias", [1]),
                                          ("truncate_prompt_tokens", 0)])
def test_messages_do_not_offer_none(field, value):
    """A JSON line has null, a command line no None: "or None" in a message only confused (null is "left out")."""
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert "None" not in str(e.value) and str(e.value).startswith(f"SamplingParams.{field}: must be")
