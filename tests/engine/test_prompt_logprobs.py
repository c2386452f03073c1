"""prompt_logprobs: every prompt token's logprob (and the top alternatives) equals HF transformers' log-softmax of
the prompt's logits, in every scheduling regime, whether or not the prompt is in the prefix cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine_vs_hf import PROMPTS

from nvcli import LLM, SamplingParams
from nvcli.outputs import RequestOutput

K = 3
SCORE = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=K)

_hf_cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-softmax that predicts prompt[i + 1]."""
    key = (str(model_dir), tuple(prompt))
    if key not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1].double()
        _hf_cache[key] = torch.log_softmax(logits, dim=-1)
    return _hf_cache[key]


def assert_matches_hf(model_dir, prompt: list[int], out: RequestOutput, k: int = K) -> None:
    ref = hf_prompt_logprobs(model_dir, prompt)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None  # nothing predicts the first token
    for i, entry in enumerate(got[1:]):
        token = prompt[i + 1]
        assert entry is not None and next(iter(entry)) == token  # the prompt's own token comes first
        assert entry[token].logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
        # rank = 1 + tokens strictly more likely; float32 against float64 may order near-ties differently
        lp = ref[i, token]
        assert int((ref[i] > lp + 1e-5).sum()) + 1 <= entry[token].rank <= int((ref[i] > lp - 1e-5).sum()) + 1
        top = ref[i].topk(k)
        alternatives = {t: lp for t, lp in entry.items() if lp.rank is not None and lp.rank <= k}
        assert sorted(alternatives) == sorted(top.indices.tolist())
        for t, lp in alternatives.items():
            assert lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-4)
            assert lp.decoded_token is not None
        assert len(entry) == k + (token not in alternatives)


REGIMES = {
    "prefix_on": dict(num_kvcache_blocks=128),
    "prefix_off": dict(num_kvcache_blocks=128, enable_prefix_caching=False),
    "preemption": dict(num_kvcache_blocks=8, max_model_len=128),
    "chunked_prefill": dict(num_kvcache_blocks=128, max_num_batched_tokens=16),
    # preempted between two chunks of a prompt: the recomputed chunks must not score their positions again
    "preemption_mid_prompt": dict(num_kvcache_blocks=8, max_model_len=128, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_prompt_logprobs_match_hf(tiny_model_dir, regime: str, async_scheduling: bool) -> None:
    model_dir = tiny_model_dir("qwen3")
    kwargs = dict(max_model_len=256, device="cpu", async_scheduling=async_scheduling)
    kwargs.update(REGIMES[regime])
    llm = LLM(str(model_dir), **kwargs)
    plain = llm.generate(PROMPTS, dataclasses.replace(SCORE, prompt_logprobs=None))
    outs = llm.generate(PROMPTS, SCORE)
    for prompt, out, ref in zip(PROMPTS, outs, plain):
        assert_matches_hf(model_dir, prompt, out)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids  # scoring changes nothing generated
        assert ref.prompt_logprobs is None
    stats = llm.stats()
    if regime.startswith("preemption"):
        assert stats.num_preemptions > 0
    if regime == "chunked_prefill":
        assert stats.num_chunked_prefills > 0
    assert stats.kv_blocks_used == 0


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_model_dir) -> None:
    """The prefix cache holds no logits: a request asking for prompt logprobs computes its whole prompt, even where
    an identical prompt's blocks are cached, and says so in num_cached_tokens."""
    model_dir = tiny_model_dir("qwen3")
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=128, max_model_len=256)
    prompt = PROMPTS[3]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0  # the plain request does read the cache
    before = llm.stats().prompt_tokens
    scored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K))[0]
    assert scored.num_cached_tokens == 0
    assert llm.stats().prompt_tokens - before == len(prompt)
    assert_matches_hf(model_dir, prompt, scored)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids


def test_n_completions_share_one_prompt_logprobs(tiny_model_dir) -> None:
    """With n > 1 the prompt is scored once; its siblings still read the prompt from the cache."""
    model_dir = tiny_model_dir("qwen3")
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=128, max_model_len=256)
    prompt = PROMPTS[3]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=0))[0]
    assert len(out.outputs) == 3
    assert_matches_hf(model_dir, prompt, out, k=0)
    tail = len(prompt) % llm.engine.config.kvcache_block_size
    assert llm.stats().prompt_tokens == len(prompt) + 2 * tail


def test_a_one_token_prompt_has_only_the_empty_first_entry(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=32, max_model_len=64)
    out = llm.generate([[17]], SamplingParams(max_tokens=2, prompt_logprobs=5))[0]
    assert out.prompt_logprobs == [None]


def test_tensor_parallel_prompt_logprobs_match_one_rank(tiny_model_dir) -> None:
    """Every TP rank runs the prompt rows' LM head (its vocab gather), chunked prefill and async included."""
    model_dir = tiny_model_dir("qwen3")
    kwargs = dict(device="cpu", num_kvcache_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    llm = LLM(str(model_dir), tensor_parallel_size=2, async_scheduling=True, **kwargs)
    try:
        outs = llm.generate(PROMPTS, SCORE)
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_hf(model_dir, prompt, out)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_rejected(bad) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
