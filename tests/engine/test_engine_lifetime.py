"""An engine is freed as soon as its last reference goes: no reference cycle keeps its model and KV cache (on a GPU,
gigabytes) alive until the garbage collector happens to run, so the next LLM in the process finds the memory free."""

from __future__ import annotations

import gc
import weakref

from nvcli import LLM, SamplingParams


def test_a_dropped_llm_frees_its_engine_and_runner_without_the_garbage_collector(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=128, num_kvcache_blocks=16)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], [sp, SamplingParams(max_tokens=2, prompt_logprobs=1, logprobs=1)])
    engine, runner = weakref.ref(llm.engine), weakref.ref(llm.engine.executor.runner)
    gc.disable()
    try:
        llm.shutdown()
        del llm
        assert engine() is None and runner() is None
    finally:
        gc.enable()

