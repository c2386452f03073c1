"""End to end on CPU: greedy output equals HF transformers token for token, in every scheduling regime."""

from __future__ import annotations

import threading

import pytest
import torch

from nvcli import LLM, SamplingParams

PROMPTS = [
    list(range(1000, 1005)),
    list(range(2000, 2040)),
    list(range(3000, 3023)),
    list(range(4000, 4070)),
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

_hf_cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def hf_greedy(model_dir, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    key = (str(model_dir), tuple(prompt), max_tokens)
    if key not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
        _hf_cache[key] = out[0, len(prompt):].tolist()
    return _hf_cache[key]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.kv_blocks_used == 0, stats
    assert stats.num_running == 0 and stats.num_waiting == 0


REGIMES = {
    "prefix_on": dict(num_kvcache_blocks=128),
    "prefix_off": dict(num_kvcache_blocks=128, enable_prefix_caching=False),
    "preemption": dict(num_kvcache_blocks=8, max_model_len=128),
    "chunked_prefill": dict(num_kvcache_blocks=128, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_hf(tiny_model_dir, arch: str, regime: str) -> None:
    check_greedy(tiny_model_dir, arch, regime, async_scheduling=False)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_hf_with_async_scheduling(tiny_model_dir, regime: str) -> None:
    """Scheduling one step ahead (tokens fed back on the device) changes no output."""
    check_greedy(tiny_model_dir, "qwen3", regime, async_scheduling=True)


def check_greedy(tiny_model_dir, arch: str, regime: str, async_scheduling: bool) -> None:
    model_dir = tiny_model_dir(arch)
    kwargs = dict(max_model_len=256, device="cpu", async_scheduling=async_scheduling)
    kwargs.update(REGIMES[regime])
    llm = LLM(str(model_dir), **kwargs)
    assert llm.engine.async_scheduling == async_scheduling
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt)
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    if regime == "preemption":
        assert stats.num_preemptions > 0
    if regime == "chunked_prefill":
        assert stats.num_chunked_prefills > 0
    assert_all_blocks_free(llm)


def test_shared_prefix_hits_the_cache_with_unchanged_output(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen3")
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=256)
    prefix = list(range(5000, 5050))
    first = prefix + [7, 8, 9]
    llm.generate([first], GREEDY)
    assert llm.stats().prefix_cache_hit_tokens == 0
    others = [prefix + [11, 12], prefix + [13]]
    outs = llm.generate(others, GREEDY)
    assert llm.stats().prefix_cache_hit_tokens >= 2 * 48
    assert outs[0].num_cached_tokens == 48
    for prompt, out in zip(others, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt)
    assert_all_blocks_free(llm)


def test_lines_sent_together_compute_their_shared_instruction_once(tiny_model_dir) -> None:
    """Prompts submitted at once behind the same instruction: the first computes it, the others wait for it and read
    it from the prefix cache (they would each have computed a copy in the same step), and every output is HF's."""
    model_dir = tiny_model_dir("qwen3")
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=256)
    prefix = list(range(6000, 6050))  # 3 full blocks and 2 tokens
    prompts = [prefix + list(range(7000 + 10 * i, 7001 + 10 * i + i % 3)) for i in range(5)]
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48, 48, 48]
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt)
    assert_all_blocks_free(llm)


def test_freed_blocks_are_reused_across_many_requests(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=16, max_model_len=128)
    prompts = [list(range(i * 100, i * 100 + 30)) for i in range(12)]  # 12 x 4 blocks >> 16 blocks
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_sampling_is_independent_of_the_batch(tiny_model_dir, async_scheduling: bool) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=64, max_model_len=256,
              async_scheduling=async_scheduling)
    target = list(range(600, 620))
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], sp)[0].outputs[0].token_ids
    others = [list(range(700, 740)), list(range(800, 805))]
    mixed = llm.generate(
        [others[0], target, others[1]],
        [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True), sp,
         SamplingParams(temperature=1.0, seed=5, max_tokens=3, ignore_eos=True)],
    )
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99,
                                                       max_tokens=16, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone  # the seed does matter
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_strings_stop_ids_min_tokens_and_logprobs(tiny_model_dir, async_scheduling: bool) -> None:
    model_dir = tiny_model_dir("qwen3")
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=256,
              async_scheduling=async_scheduling)
    prompt = list(range(1000, 1005))
    ref = hf_greedy(model_dir, prompt)
    tok = llm.get_tokenizer()
    full_text = tok.decode(ref)
    # stop token id: the 5th generated token
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[4]]))[0].outputs[0]
    cut = ref.index(ref[4]) + 1
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop" and out.stop_reason == ref[4]
    # the stop token's own text is not in the output text (vLLM), unless include_stop_str_in_output
    assert out.text == tok.decode(ref[: cut - 1])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[4]],
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == tok.decode(ref[:cut])
    # min_tokens: the stop id is never drawn before then (vLLM masks it), so greedy takes the next best token
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=24,
                                                stop_token_ids=[ref[0]], logprobs=1))[0].outputs[0]
    assert len(out.token_ids) == 24 and ref[0] not in out.token_ids and out.token_ids[0] != ref[0]
    first = out.logprobs[0]  # the model's own logits: ref[0] is still the likeliest, rank 1
    assert first[ref[0]].rank == 1 and first[ref[0]].logprob > first[out.token_ids[0]].logprob
    assert first[out.token_ids[0]].rank == 2
    # once min_tokens is reached the stop id ends the request again
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=2,
                                                 stop_token_ids=[ref[0]]))[0].outputs[0]
    assert ref[0] not in free.token_ids[:2] and (ref[0] not in free.token_ids or free.token_ids[-1] == ref[0])
    # a stop string is cut from the text
    stop = tok.decode(ref[6:8])
    if stop.strip() and full_text.find(stop) > 0:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == full_text[: full_text.find(stop)]
    # logprobs of the sampled token equal HF's log-softmax
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True))[0]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:3]])).logits[0, len(prompt) - 1 :]
    ref_lp = torch.log_softmax(logits, -1)
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for i, entry in enumerate(lps):
        tid = ref[i]
        assert list(entry)[0] == tid and len(entry) >= 2
        assert entry[tid].logprob == pytest.approx(ref_lp[i, tid].item(), abs=1e-4)  # vLLM's Logprob objects
        assert entry[tid].rank == 1 + int((ref_lp[i] > ref_lp[i, tid]).sum())
        assert entry[tid].decoded_token == tok.decode([tid])
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, len(entry) + 1))  # greedy: the top-n
    assert_all_blocks_free(llm)


def test_requests_added_from_a_producer_thread(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=64, max_model_len=256)
    engine = llm.engine
    prompts = [list(range(i * 10 + 1, i * 10 + 12)) for i in range(10)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    done: dict[str, list[int]] = {}
    producer_done = threading.Event()

    def produce() -> None:
        for i, p in enumerate(prompts):
            engine.add_request(p, sp, request_id=f"r{i}")
        producer_done.set()

    t = threading.Thread(target=produce)
    t.start()
    while not producer_done.is_set() or engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    t.join()
    assert sorted(done) == sorted(f"r{i}" for i in range(10))
    batch = llm.generate(prompts, sp)
    assert [done[f"r{i}"] for i in range(10)] == [o.outputs[0].token_ids for o in batch]


def test_bad_requests_raise_clear_errors(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="raise max_model_len"):  # the Python API names its argument
        llm.generate([list(range(100))], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1, -5]], GREEDY)
    assert_all_blocks_free(llm)


def test_text_prompts_and_chat(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen3")
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=256)
    tok = llm.get_tokenizer()
    out = llm.generate("Hello there", GREEDY)[0]
    assert out.prompt_token_ids == tok("Hello there").input_ids
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    chat = llm.chat(msgs, GREEDY, chat_template_kwargs={"enable_thinking": False})[0]
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert chat.prompt_token_ids == tok(expected, add_special_tokens=False).input_ids
    assert chat.prompt == expected  # vLLM returns the rendered conversation as the prompt
    assert chat.outputs[0].token_ids == hf_greedy(model_dir, chat.prompt_token_ids)
    # vLLM's chat options: no assistant turn opened, or the last (assistant) message continued
    turns = msgs + [{"role": "assistant", "content": "The answer is"}]
    kw = {"enable_thinking": False}
    plain = llm.chat(msgs, GREEDY, chat_template_kwargs=kw, add_generation_prompt=False)[0]
    assert plain.prompt == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **kw)
    cont = llm.chat(turns, GREEDY, chat_template_kwargs=kw, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("The answer is") and cont.prompt == tok.apply_chat_template(
        turns, tokenize=False, continue_final_message=True, **kw)
    with pytest.raises(ValueError, match="cannot both be set"):
        llm.chat(turns, GREEDY, continue_final_message=True)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("regime", ["prefix_off", "chunked_prefill"])
def test_greedy_matches_hf_with_deferred_norm(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, arch: str,
                                              regime: str) -> None:
    """Deferred RMSNorm (models/llama.py: norm weights folded into the projections, the 1 / RMS applied after
    them, residual adds inside the o_proj / down GEMMs) at every step, prompt, mixed and decode: still HF's tokens.
    Qwen2's biased qkv projection keeps the explicit norms (a bias is added after the scaling)."""
    from nvcli.models import llama

    calls = []
    real = llama.DecoderLayer.forward_deferred

    def counting(self, *args, **kw):
        calls.append(1)
        return real(self, *args, **kw)

    monkeypatch.setattr(llama, "DEFERRED_NORM_MIN_ROWS", 1)
    monkeypatch.setattr(llama.DecoderLayer, "forward_deferred", counting)
    check_greedy(tiny_model_dir, arch, regime, async_scheduling=False)
    assert bool(calls) == (arch != "qwen2")


def test_norm_weights_are_folded_into_the_projections(tiny_model_dir) -> None:
    """After loading, each decoder norm has weight 1 and its projection carries the checkpoint's norm weight in
    its input columns; the final norm (before the tied LM head) keeps its own."""
    from safetensors.torch import load_file

    model_dir = tiny_model_dir("qwen3")
    ckpt = load_file(str(model_dir / "model.safetensors"))
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, num_kvcache_blocks=16)
    try:
        model = llm.engine.executor.runner.model.model
        layer = model.layers[0]
        g = ckpt["model.layers.0.input_layernorm.weight"]
        assert not torch.allclose(g, torch.ones_like(g))
        assert torch.equal(layer.input_layernorm.weight, torch.ones_like(g))
        torch.testing.assert_close(layer.self_attn.qkv_proj.weight[:8],
                                   ckpt["model.layers.0.self_attn.q_proj.weight"][:8] * g)
        g2 = ckpt["model.layers.0.post_attention_layernorm.weight"]
        torch.testing.assert_close(layer.mlp.gate_up_proj.weight[:8], ckpt["model.layers.0.mlp.gate_proj.weight"][:8] * g2)
        torch.testing.assert_close(model.norm.weight, ckpt["model.norm.weight"])
    finally:
        llm.shutdown()


def test_preemption_does_not_count_as_prefix_cache_hits(tiny_model_dir) -> None:
    """A preempted request re-admitted finds its own blocks in the prefix cache. Those are not prefix-cache hits of
    its prompt: num_cached_tokens and the hit rate count first admissions only (vLLM's meaning); they used to report
    more cached tokens than the prompt had."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=6, max_model_len=64, kvcache_block_size=16)
    prompts = [list(range(100 * i, 100 * i + 17)) for i in (1, 2, 3)]  # distinct: nothing to hit
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert stats.prefix_cache_hit_tokens == 0 and stats.prefix_cache_query_tokens == 3 * 17


def test_a_bad_prompt_in_generate_leaves_nothing_queued(tiny_model_dir) -> None:
    """generate() refuses a batch with an empty prompt; the prompts queued before it are aborted, not run (to
    max_model_len, unseen) inside the next call."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=64, max_model_len=128)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["Hello", ""], SamplingParams(max_tokens=None, ignore_eos=True))
    assert not llm.engine.has_unfinished()
    before = llm.stats().generation_tokens
    out = llm.generate(["World"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2
    assert llm.stats().generation_tokens - before == 2
    assert_all_blocks_free(llm)
