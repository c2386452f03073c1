"""nvcli/llm.py: LLM.chat's vLLM options for tool calling, `tools` and `chat_template` (a tiny random Qwen3 on CPU)."""

from __future__ import annotations

import pytest

from nvcli import LLM, SamplingParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=64, max_model_len=512)
    yield llm
    llm.shutdown()


def test_chat_offers_tools_and_takes_an_openai_tool_call_turn(llm):
    """As vLLM's LLM.chat: the tools go to the template, an assistant turn's null content renders as "" and its
    arguments' JSON text as the object it holds."""
    convo = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = llm.chat(convo, GREEDY, chat_template_kwargs={"enable_thinking": False}, tools=[WEATHER])[0]
    parsed = [convo[0], {**convo[1], "content": "", "tool_calls": [
        {**convo[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, convo[2]]
    assert out.prompt == llm.tokenizer.apply_chat_template(parsed, tools=[WEATHER], tokenize=False,
                                                           add_generation_prompt=True, enable_thinking=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out.prompt
    assert '"name": "get_weather"' in out.prompt.split("\n</tools>")[0]
    assert convo[1]["content"] is None  # the caller's messages are left as they were
    assert len(out.outputs[0].token_ids) == 2


def test_chat_template_replaces_the_models(llm):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if tools %}{{ tools | length }} tools{% endif %}"
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template, tools=[WEATHER])[0]
    assert out.prompt == "[user] hi\n1 tools"
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template)[0]
    assert out.prompt == "[user] hi\n"


def test_tools_with_a_template_that_cannot_render_them_are_refused(llm):
    with pytest.raises(ValueError, match="does not render tools"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template="{{ messages[0].content }}", tools=[WEATHER])


def test_max_tokens_beyond_the_context_is_refused_as_vllm_does(llm):
    """vLLM answers 400 where the prompt plus max_tokens exceeds max_model_len: such a request could never finish as
    asked (a job line with max_tokens 100000 once ran for 15 minutes). Up to the context it is served."""
    with pytest.raises(ValueError, match=r"max_tokens=600 is too large: the prompt has 3 tokens and "
                                         r"max_model_len=512 leaves room for 509 more"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=600))
    assert not llm.engine.has_unfinished()
    rid = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=509))
    llm.engine.abort(rid)
    while llm.engine.has_unfinished():
        llm.engine.step()


def test_errors_name_python_arguments_not_flags(tmp_path, monkeypatch, tiny_model_dir):
    """The Python API's errors name its arguments: LLM("Qwen/Qwen3-0.6B") on a machine without it in the local cache
    said "--model Qwen/Qwen3-0.6B: ...". The exception keeps its type."""
    from nvcli.config import ConfigError
    from nvcli.models.resolve import ModelNotFoundError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelNotFoundError) as e:
        LLM("Qwen/Qwen3-0.6B")
    assert str(e.value).startswith("model='Qwen/Qwen3-0.6B': not in the local Hugging Face cache")
    assert "--model" not in str(e.value) and "pass model='/path/to/model-dir'" in str(e.value)
    with pytest.raises(ConfigError, match=r"^max_num_seqs: must be a positive integer"):
        LLM(max_num_seqs=0)
    with pytest.raises(ConfigError, match=r"^kvcache_block_size: must be a power of two"):
        LLM(kvcache_block_size=24)
    with pytest.raises(ConfigError, match=r"^max_model_len=10000000 exceeds the model's"):
        LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=10_000_000)


def test_a_prompt_error_names_the_argument(llm):
    with pytest.raises(ValueError, match=r"leaves no room to generate \(shorten the prompt or raise max_model_len\)"):
        llm.generate([[1] * 600], SamplingParams(max_tokens=1))


def test_generate_serves_prompts_by_priority_with_one_slot(tiny_model_dir):
    """vLLM's LLM.generate(priority=[...]) under scheduling_policy="priority": with one sequence at a time the prompts
    finish lowest priority first, ties in prompt order; the outputs still come back in prompt order."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=64, max_model_len=512, max_num_seqs=1,
              scheduling_policy="priority")
    try:
        finished: list[str] = []
        step = llm.engine.step

        def recording_step():
            outs = step()
            finished.extend(o.request_id for o in outs)
            return outs

        llm.engine.step = recording_step  # type: ignore[method-assign]
        prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15]]
        outs = llm.generate(prompts, GREEDY, priority=[2, 0, 1, 0, -1])
        assert [o.prompt_token_ids for o in outs] == prompts
        ids = [o.request_id for o in outs]
        assert [ids.index(rid) for rid in finished] == [4, 1, 3, 2, 0]
        with pytest.raises(ValueError, match=r"^got 2 priorities for 3 prompts$"):
            llm.generate(prompts[:3], GREEDY, priority=[0, 1])
        with pytest.raises(ValueError, match=r"^priority must be an integer"):
            llm.generate(prompts[:1], GREEDY, priority=[0.5])
        assert not llm.engine.has_unfinished()
    finally:
        llm.shutdown()


def test_a_priority_without_the_priority_policy_is_refused_as_vllm_does(llm):
    with pytest.raises(ValueError, match=r"^priority=1: priority scheduling is not enabled \(pass "
                                         r"scheduling_policy='priority'\)$"):
        llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY, priority=[0, 1])
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], GREEDY, priority=[0])[0].outputs[0].token_ids) == 2
