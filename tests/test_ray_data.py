"""nvcli.ray_data: the class Ray Data's map_batches runs in each replica (called here as Ray Data would call it)."""

from __future__ import annotations

import numpy as np
import pytest

from nvcli.ray_data import NvProcessor, build_nv_processor


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    p = NvProcessor(model=str(tiny_model_dir("qwen3")), sampling_params={"temperature": 0.0, "max_tokens": 5,
                                                                         "ignore_eos": True},
                    device="cpu", num_kvcache_blocks=64, max_model_len=256)
    yield p
    p.llm.shutdown()


def test_a_batch_of_prompts_gets_its_completions_beside_its_columns(processor):
    batch = {"id": np.array([7, 8]), "prompt": np.array(["Hello there", "The capital of France is"])}
    out = processor(batch)
    assert list(out["id"]) == [7, 8]
    assert out["num_generated_tokens"] == [5, 5] and out["finish_reason"] == ["length", "length"]
    want = [o.outputs[0].text for o in processor.llm.generate(["Hello there", "The capital of France is"],
                                                             processor.params)]
    assert out["generated_text"] == want


def test_chat_rows_and_a_batch_without_prompts(processor):
    out = processor({"messages": np.array([[{"role": "user", "content": "hi"}]], dtype=object)})
    assert len(out["generated_text"]) == 1 and out["num_generated_tokens"] == [5]
    with pytest.raises(ValueError, match="each row needs a 'prompt' or 'messages' column"):
        processor({"text": np.array(["x"])})


def test_build_nv_processor_maps_batches_on_actors_of_its_gpus():
    seen = {}

    class Dataset:
        def map_batches(self, fn, **kw):
            seen.update(kw, fn=fn)
            return "mapped"

    assert build_nv_processor(model="m", concurrency=3, num_gpus=2, sampling_params={"max_tokens": 9},
                              tensor_parallel_size=2)(Dataset()) == "mapped"
    assert seen["fn"] is NvProcessor and seen["concurrency"] == 3 and seen["num_gpus"] == 2
    assert seen["fn_constructor_kwargs"] == {"model": "m", "sampling_params": {"max_tokens": 9},
                                             "tensor_parallel_size": 2}
