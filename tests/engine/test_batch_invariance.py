"""--batch-invariant: a request's tokens and logprobs are the same bits alone, beside other requests, and with its
prompt chunked differently (a seeded request gets the same tokens whatever else is in the batch).

On the CPU the engine runs every row alone (models/llama.py, DecoderModel._forward_invariant); on a GPU its batch-
invariant kernels, in bf16 too, where without the flag a row's logits move with its step's row count."""

from __future__ import annotations

import random

import pytest
import torch

from nvcli import LLM, SamplingParams

DTYPES = ["auto"] + (["bfloat16"] if torch.cuda.is_available() else [])


def _prompts() -> tuple[list[int], list[list[int]]]:
    rnd = random.Random(1)
    target = [rnd.randint(5, 3000) for _ in range(150)]  # past the attention kernel's 64-token KV tiles
    others = [[rnd.randint(5, 3000) for _ in range(rnd.randint(3, 130))] for _ in range(7)]
    return target, others


def _run(model: str, dtype: str, batched: int, prompts: list[list[int]], params: list[SamplingParams],
         idx: int | list[int], blocks: int = 128, prefix_caching: bool = False, first: list[int] | None = None,
         preempts: bool = False, **engine: object):
    """(tokens, logprobs, prompt logprobs) of the request at `idx` (a list of them for a list of indices)."""
    llm = LLM(model, max_num_batched_tokens=batched, batch_invariant=True, enable_prefix_caching=prefix_caching,
              dtype=dtype, num_kvcache_blocks=blocks, **engine)
    if first is not None:  # an earlier request, whose blocks the prefix cache keeps
        llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=1))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert (llm.engine.stats().num_preemptions > 0) == preempts
    llm.shutdown()
    return [_bits(outs[i]) for i in idx] if isinstance(idx, list) else _bits(outs[idx])


def _bits(out):
    o = out.outputs[0]
    sampled = [{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs]
    prompt = [None if pos is None else {t: lp.logprob for t, lp in pos.items()} for pos in out.prompt_logprobs or []]
    return o.token_ids, sampled, prompt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperatures, kv_cache_dtype", [((1.0, 0.0), "auto"), ((1.0,), "fp8")],
                         ids=["seeded+greedy-auto", "seeded-fp8"])
def test_a_request_is_the_same_alone_in_a_batch_and_chunked(tiny_model_dir, dtype: str, temperatures: tuple[float, ...],
                                                              kv_cache_dtype: str) -> None:
    """fp8 caches too: a token's K/V are quantized alone, against the cache's fixed scales, and read back the same
    whichever layout its page has (an open page token-major, a sealed one dims-major: kernels/kv_layout.py).
    A seeded and a greedy request (the same prompt) share the batched and chunked runs; each is also run alone."""
    model = str(tiny_model_dir("qwen3"))
    target, others = _prompts()
    sps = [SamplingParams(temperature=t, seed=7, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True)
           for t in temperatures]
    neighbour = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    kv = dict(kv_cache_dtype=kv_cache_dtype)
    n = len(sps)
    alone = [_run(model, dtype, 8192, [target], [sp], 0, **kv) for sp in sps]
    for a in alone:
        assert len(a[0]) == 12 and len(a[1]) == 12 and len(a[2]) == len(target)
    # beside seven other prompts in the same steps, then among them with a 40-token budget that chunks every prompt
    # (chunk starts off the KV tiles' 64-token grid)
    batch = _run(model, dtype, 8192, [target] * n + others, sps + [neighbour] * 7, list(range(n)), **kv)
    chunked = _run(model, dtype, 40, [*others[:3], *[target] * n, *others[3:]], [neighbour] * 3 + sps + [neighbour] * 4,
                   list(range(3, 3 + n)), **kv)
    if n > 1:
        assert alone[0][0] != alone[1][0]  # the sampled request's tokens are not the greedy ones
    for i in range(n):
        for other in (batch[i], chunked[i]):
            assert other[0] == alone[i][0]  # tokens
            assert other[1] == alone[i][1]  # each position's logprobs (the token's and its top 3), as floats: bit for bit
            assert other[2] == alone[i][2]  # prompt logprobs


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_hits_and_preemption_keep_the_bits(tiny_model_dir, dtype: str) -> None:
    """Cached K/V are the bits a recompute writes, and a preempted request recomputed from its tokens goes on as it
    would have."""
    model = str(tiny_model_dir("qwen3"))
    target, others = _prompts()
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=24, logprobs=2, ignore_eos=True)
    neighbour = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    alone = _run(model, dtype, 8192, [target], [sp], 0)
    # the first 96 tokens (six blocks) come from an earlier request's cached blocks
    cached = _run(model, dtype, 8192, [target], [sp], 0, prefix_caching=True, first=target[:100] + [1, 2, 3])
    # 18 KV blocks for three requests that need about 30: requests are preempted and recomputed
    preempted = _run(model, dtype, 64, [others[0], target, others[1]], [neighbour, sp, neighbour], 1, blocks=18,
                     preempts=True)
    for other in (cached, preempted):
        assert other[0] == alone[0] and other[1] == alone[1]


TP_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("device", TP_DEVICES)
def test_tensor_parallel_keeps_the_bits(tiny_model_dir, device: str) -> None:
    """--tp 2: each rank runs the invariant forward on its shards and the row-parallel layers' parts are summed in
    rank order (distributed.all_reduce; its own test shows why that matters from three ranks on). On the CPU every
    row runs alone anyway; on GPUs the rows of a step go through the kernels together."""
    model = str(tiny_model_dir("qwen3"))
    target, others = _prompts()
    target, others = target[:70], others[:4]
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=12, logprobs=2, ignore_eos=True)
    neighbour = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    tp = dict(tensor_parallel_size=2, device=device, max_model_len=512)
    dtype = "bfloat16" if device == "cuda" else "auto"
    alone = _run(model, dtype, 8192, [target], [sp], 0, **tp)
    # beside four others, every prompt chunked by a 24-token budget
    chunked = _run(model, dtype, 24, [*others[:2], target, *others[2:]], [neighbour] * 2 + [sp] + [neighbour] * 2,
                   2, **tp)
    assert len(alone[0]) == 12
    assert chunked[0] == alone[0] and chunked[1] == alone[1]
