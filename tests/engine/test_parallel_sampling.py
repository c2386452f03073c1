"""`n` completions per prompt (vLLM's parallel sampling), on CPU with a tiny random model."""

from __future__ import annotations

import pytest
from test_engine_vs_hf import hf_greedy

from nvcli import LLM, SamplingParams

PROMPT = list(range(1000, 1070))  # 70 tokens: four full 16-token blocks the completions can share


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=128, max_model_len=256)


def test_greedy_completions_each_equal_hf(llm, tiny_model_dir):
    [out] = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    want = hf_greedy(tiny_model_dir("qwen3"), PROMPT, 12)
    assert all(c.token_ids == want for c in out.outputs)
    assert out.prompt_token_ids == PROMPT


def test_seeded_completion_i_draws_from_seed_plus_i(llm):
    """vLLM's rule: with a seed, completion i is the n=1 request with seed + i, whatever runs beside it."""
    sp = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    [out] = llm.generate([PROMPT], SamplingParams(n=4, seed=7, **sp))
    singles = llm.generate([PROMPT] * 4, [SamplingParams(seed=7 + i, **sp) for i in range(4)])
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # not four copies of one draw


def test_unseeded_completions_are_independent_draws(llm):
    [out] = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=10, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_the_prompt_is_computed_once_and_shared(llm):
    """Completions 1..n-1 wait for completion 0's prompt blocks and find them in the prefix cache: they compute
    only the partial last block (and the one token always recomputed), not the whole prompt again."""
    llm.engine.reset_prefix_cache()
    before = llm.stats().prompt_tokens
    prompt = list(range(5000, 5070))
    [out] = llm.generate([prompt], SamplingParams(n=4, temperature=0.8, max_tokens=4, ignore_eos=True))
    computed = llm.stats().prompt_tokens - before
    assert computed == len(prompt) + 3 * (len(prompt) - 64), computed  # 64 = four cached 16-token blocks
    assert out.num_cached_tokens == 0  # the first completion computed it


def test_mixed_n_in_one_batch_and_per_prompt_params(llm):
    outs = llm.generate([PROMPT, PROMPT[:20], [5, 6, 7]], [
        SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(n=1, temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(n=3, temperature=0, max_tokens=1, ignore_eos=True),  # short prompt: nothing to share
    ])
    assert [len(o.outputs) for o in outs] == [2, 1, 3]
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [5, 5, 3, 1, 1, 1]
    assert llm.stats().kv_blocks_used == 0 and not llm.engine.has_unfinished()


def test_abort_ends_every_completion_once(llm):
    """Aborting a request with completions still held (waiting for the prompt) returns one output, all aborted."""
    engine = llm.engine
    rid = engine.add_request(list(range(3000, 3070)), SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    assert llm.stats().num_waiting == 3  # the held completions count as waiting (the dashboard shows them)
    engine.abort(rid)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [rid]
    assert [c.finish_reason for c in outs[0].outputs] == ["abort"] * 3
    assert llm.stats().kv_blocks_used == 0 and llm.stats().num_waiting == 0


def test_abort_mid_generation(llm):
    engine = llm.engine
    rid = engine.add_request(list(range(3100, 3170)), SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    outs = []
    for _ in range(4):  # completion 0's prompt, then all three decode
        outs += engine.step()
    engine.abort(rid)
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [rid]
    assert [c.finish_reason for c in outs[0].outputs] == ["abort"] * 3
    assert all(c.token_ids for c in outs[0].outputs)  # each had generated before the abort
    assert llm.stats().kv_blocks_used == 0


def test_n_is_validated():
    with pytest.raises(ValueError, match="n: must be a positive integer"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n: must be a positive integer"):
        SamplingParams(n=2.0)  # type: ignore[arg-type]
