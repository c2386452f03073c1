"""--batch-invariant: a request's tokens and logprobs are the same bits alone, beside other requests, and with its
prompt chunked differently (DESIGN.md §3: a seeded request gets the same tokens whatever else is in the batch).

On the CPU the engine runs every row alone (models/llama.py, DecoderModel._forward_invariant); on a GPU its batch-
invariant kernels, in bf16 too, where without the flag a row's logits move with its step's row count."""

from __future__ import annotations

import random

import pytest
import torch

from nvcli import LLM, SamplingParams
from nvcli.config import ConfigError, EngineConfig

DTYPES = ["auto"] + (["bfloat16"] if torch.cuda.is_available() else [])


def _prompts() -> tuple[list[int], list[list[int]]]:
    rnd = random.Random(1)
    target = [rnd.randint(5, 3000) for _ in range(150)]  # past the attention kernel's 64-token KV tiles
    others = [[rnd.randint(5, 3000) for _ in range(rnd.randint(3, 130))] for _ in range(7)]
    return target, others


def _run(model: str, dtype: str, batched: int, prompts: list[list[int]], params: list[SamplingParams], idx: int):
    llm = LLM(model, max_num_batched_tokens=batched, batch_invariant=True, enable_prefix_caching=False, dtype=dtype,
              num_kvcache_blocks=128)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)[idx]
    o = out.outputs[0]
    sampled = [{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs]
    prompt = [None if pos is None else {t: lp.logprob for t, lp in pos.items()} for pos in out.prompt_logprobs]
    return o.token_ids, sampled, prompt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_request_is_the_same_alone_in_a_batch_and_chunked(tiny_model_dir, dtype: str, temperature: float) -> None:
    model = str(tiny_model_dir("qwen3"))
    target, others = _prompts()
    sp = SamplingParams(temperature=temperature, seed=7, max_tokens=24, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    neighbour = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    alone = _run(model, dtype, 8192, [target], [sp], 0)
    assert len(alone[0]) == 24 and len(alone[1]) == 24 and len(alone[2]) == len(target)
    # beside seven other prompts in the same steps, then among them with a 40-token budget that chunks every prompt
    # (chunk starts off the KV tiles' 64-token grid)
    batch = _run(model, dtype, 8192, [target, *others], [sp] + [neighbour] * 7, 0)
    chunked = _run(model, dtype, 40, [*others[:3], target, *others[3:]], [neighbour] * 3 + [sp] + [neighbour] * 4, 3)
    for other in (batch, chunked):
        assert other[0] == alone[0]  # tokens
        assert other[1] == alone[1]  # each position's logprobs (the token's and its top 3), as floats: bit for bit
        assert other[2] == alone[2]  # prompt logprobs


def test_batch_invariant_refuses_what_it_cannot_keep() -> None:
    with pytest.raises(ConfigError, match="--batch-invariant.*tensor-parallel"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="--batch-invariant.*fp8"):
        EngineConfig(batch_invariant=True, kv_cache_dtype="fp8")
