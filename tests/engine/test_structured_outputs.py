"""Structured outputs (vLLM's StructuredOutputsParams, through llguidance): on a random tiny model, whose unconstrained
text is noise, every constrained output is what its constraint accepts, in every scheduling regime; neighbours and
logprobs behave as in vLLM; constraints that do not compile are refused when the request is added."""

from __future__ import annotations

import json
import re

import pytest
import torch

from nvcli import LLM, SamplingParams, StructuredOutputsParams
from nvcli.engine.structured_output import closed_objects

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "color", "count", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}(!|\?)"
CHOICES = ["yes", "no", 'say "hi"\n', "naïve \\ café"]
LARK = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: "bob" | "alice" | "eve"'
GBNF = 'root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= "bob" | "alice" | "eve"'  # LARK, as llama.cpp


def schema_ok(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"ok", "color", "count", "tags"}
            and isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
            and type(value["count"]) is int and 0 <= value["count"] <= 99
            and isinstance(value["tags"], list) and len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b"})


def constrained(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=64,
                          structured_outputs=StructuredOutputsParams(**constraint))


def check(text: str, finish_reason: str, constraint: dict) -> None:
    assert finish_reason == "stop", (text, constraint)
    if "json" in constraint:
        assert schema_ok(json.loads(text)), text
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    elif "choice" in constraint:
        assert text in constraint["choice"], text
    else:
        assert re.fullmatch(r"(hi|hello) (bob|alice|eve)", text), text


CONSTRAINTS = [dict(json=SCHEMA, disable_any_whitespace=True), dict(regex=REGEX), dict(choice=CHOICES),
               dict(grammar=LARK), dict(grammar=GBNF)]
REGIMES = {
    "plain": dict(num_kvcache_blocks=128),
    "preemption": dict(num_kvcache_blocks=10, max_model_len=128),
    "chunked_prefill": dict(num_kvcache_blocks=128, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_every_output_is_what_its_constraint_accepts(tiny_model_dir, regime: str, async_scheduling: bool) -> None:
    """Sampled at temperature 1 from a random model, beside unconstrained rows: each constrained text parses, matches
    or is one of the choices, and ends with finish_reason "stop" (the constraint complete, its last token kept)."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", async_scheduling=async_scheduling,
              **{"max_model_len": 256, **REGIMES[regime]})
    prompts, params, wanted = [], [], []
    for seed in range(3):
        for i, c in enumerate(CONSTRAINTS):
            prompts.append(f"request {seed} {i} " + "word " * (5 + 7 * i))  # prompts of 1-3 pages
            params.append(constrained(seed * 10 + i, **c))
            wanted.append(c)
        prompts.append("plain text " * 4)
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=48, ignore_eos=True))
        wanted.append(None)
    outs = llm.generate(prompts, params)
    for out, c in zip(outs, wanted):
        comp = out.outputs[0]
        if c is None:
            assert comp.finish_reason == "length" and len(comp.token_ids) == 48
        else:
            check(comp.text, comp.finish_reason, c)
    if regime == "preemption":
        assert llm.engine.stats().num_preemptions > 0, "the regime must preempt to test it"


def test_unconstrained_rows_draw_what_they_draw_alone(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(["one two three", "four five"], plain)]
    mixed = llm.generate(["x y", "one two three", "z", "four five"],
                         [constrained(1, regex=REGEX), plain[0], constrained(2, choice=CHOICES), plain[1]])
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == alone
    check(mixed[0].outputs[0].text, mixed[0].outputs[0].finish_reason, dict(regex=REGEX))


def test_n_completions_each_follow_the_constraint_on_their_own(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=64,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    (out,) = llm.generate(["a prompt long enough to fill more than one page of the cache " * 2], sp)
    assert len(out.outputs) == 4
    for comp in out.outputs:
        check(comp.text, comp.finish_reason, dict(json=SCHEMA))
    assert len({c.text for c in out.outputs}) > 1  # four matchers, four draws: not one output copied


def test_logprobs_are_those_of_the_constrained_distribution(tiny_model_dir) -> None:
    """vLLM applies the grammar's mask before the logprobs: the first token of a two-way choice has only the tokens
    that spell a prefix of a choice as finite alternatives ("a", "al", ..., "omega": fewer than 20), and their
    probabilities sum to 1."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=8, logprobs=20,
                        structured_outputs=StructuredOutputsParams(choice=["alpha", "omega"]))
    (out,) = llm.generate(["pick one"], sp)
    comp = out.outputs[0]
    assert comp.text in ("alpha", "omega")
    first = comp.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > float("-inf")}
    tokenizer = llm.get_tokenizer()
    starts = {tokenizer.decode([t]) for t in finite}
    assert all("alpha".startswith(s) or "omega".startswith(s) for s in starts), starts
    assert 2 <= len(finite) < 20  # all the allowed tokens are among the top 20, the rest are -inf
    assert sum(torch.tensor(list(finite.values())).exp()).item() == pytest.approx(1.0, abs=1e-4)


def test_ignore_eos_still_ends_a_complete_constraint(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (out,) = llm.generate(["?"], sp)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


def test_json_object_and_whitespace(tiny_model_dir) -> None:
    """json_object: the output opens a JSON object (and, where it ends, is one); disable_any_whitespace keeps the
    schema's output compact."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    outs = llm.generate(["{"] * 3, [constrained(s, json_object=True) for s in range(3)])
    for out in outs:
        comp = out.outputs[0]
        assert comp.text.lstrip().startswith("{"), comp.text
        if comp.finish_reason == "stop":
            assert isinstance(json.loads(comp.text), dict)
    compact = llm.generate(["x"] * 3, [constrained(s, json=SCHEMA, disable_any_whitespace=True) for s in range(3)])
    for out in compact:
        assert not re.search(r"\s", out.outputs[0].text), out.outputs[0].text


TAGGED = {"<a>": SCHEMA, "<b>": {"enum": ["x", "y"]}}  # two structures, one trigger


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_structural_tag_constrains_each_segment_that_follows_its_trigger(tiny_model_dir,
                                                                           async_scheduling: bool) -> None:
    """vLLM's structural tag: the text is free until a trigger; from there it is one of the structures that begin with
    it (its begin, JSON that matches its schema, its end), then free again. A bias on "<" makes the random model
    reach the trigger wherever the text is free: every "<" in the output must open a whole segment, each checked.
    (A token that closes a segment may carry free text on: "</a" + ">(".)"""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128,
              async_scheduling=async_scheduling)
    (lt,) = llm.get_tokenizer().encode("<", add_special_tokens=False)
    tag = {"triggers": ["<"], "structures": [{"begin": begin, "schema": schema, "end": "</" + begin[1:]}
                                             for begin, schema in TAGGED.items()]}
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=96, logit_bias={lt: 100},
                             structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(tag),
                                                                        disable_any_whitespace=True))
              for seed in range(4)]
    outs = llm.generate(["tagged text"] * 4 + ["plain"],
                        [*params, SamplingParams(temperature=1.0, seed=9, max_tokens=96, logit_bias={lt: 100})])
    plain = outs[-1].outputs[0].text
    assert plain.startswith("<<<"), plain  # the bias alone: "<" after "<", never a structure
    segment = re.compile(r"<(a|b)>(.*?)</\1>", re.S)
    seen: list[str] = []
    for out in outs[:-1]:
        text, pos = out.outputs[0].text, 0
        while (start := text.find("<", pos)) >= 0:
            m = segment.match(text, start)
            if m is None:  # max_tokens cut the last segment: the rest is the start of one
                assert re.fullmatch(r"<(a>|b>)?[^<\s]*", text[start:]), text
                break
            value = json.loads(m.group(2))
            assert schema_ok(value) if m.group(1) == "a" else value in ("x", "y"), m.group(0)
            seen.append(m.group(1))
            pos = m.end()
        assert out.outputs[0].finish_reason == "length"
    assert len(seen) >= 8 and set(seen) == {"a", "b"}, seen  # segment after segment, of both structures


def test_with_a_reasoning_parser_a_constraint_starts_after_the_reasoning(tiny_model_dir) -> None:
    """vLLM's rule under --reasoning-parser: the tokens before </think> are free (the random model never writes one
    by itself, so a prompt that opens <think> runs free to max_tokens); </think> itself is not the constraint's, and
    what follows it is; a prompt whose reasoning has already ended (Qwen3's template with thinking off) is
    constrained from its first token."""
    model = str(tiny_model_dir("qwen3"))
    llm = LLM(model, device="cpu", max_model_len=256, num_kvcache_blocks=128, reasoning_parser="qwen3")
    tok = llm.get_tokenizer()
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    question = tok.encode("pick one", add_special_tokens=False)

    def params(seed: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=24,
                              structured_outputs=StructuredOutputsParams(choice=CHOICES), **kw)

    thinking, ended, forced = llm.generate(
        [{"prompt_token_ids": question + [start]}, {"prompt_token_ids": question + [start, end]},
         {"prompt_token_ids": question}],
        [params(1), params(2), params(3, logit_bias={end: 100})])
    assert thinking.outputs[0].finish_reason == "length" and len(thinking.outputs[0].token_ids) == 24
    assert thinking.outputs[0].text not in CHOICES
    check(ended.outputs[0].text, ended.outputs[0].finish_reason, dict(choice=CHOICES))
    text = forced.outputs[0].text  # the bias makes </think> the first token; the constraint takes the rest
    assert forced.outputs[0].token_ids[0] == end and text.startswith("</think>"), text
    check(text.removeprefix("</think>"), forced.outputs[0].finish_reason, dict(choice=CHOICES))
    # without the parser the same thinking prompt is constrained at once, and with the parser told to constrain the
    # reasoning too (vLLM's enable_in_reasoning)
    for kw in ({}, dict(reasoning_parser="qwen3", structured_outputs_in_reasoning=True)):
        (plain,) = LLM(model, device="cpu", max_model_len=256, num_kvcache_blocks=128, **kw).generate(
            [{"prompt_token_ids": question + [start]}], [params(1)])
        check(plain.outputs[0].text, plain.outputs[0].finish_reason, dict(choice=CHOICES))


def test_disable_additional_properties_closes_every_listed_object(tiny_model_dir) -> None:
    """vLLM's disable_additional_properties: an object that lists properties takes no other keys (without it, JSON
    schema lets any key in, and the random model adds some)."""
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}}
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True, disable_additional_properties=True)) for seed in range(6)]
    for out in llm.generate(["{"] * 6, params):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop" and set(json.loads(comp.text)) <= {"k"}, comp.text
    assert closed_objects({"items": [{"properties": {}}, {"properties": {}, "additionalProperties": True}]}) == {
        "items": [{"properties": {}, "additionalProperties": False}, {"properties": {}, "additionalProperties": True}]}


def test_json_has_only_the_whitespace_its_pattern_allows(tiny_model_dir) -> None:
    """vLLM's whitespace_pattern: between JSON's tokens only what the pattern matches. Without it this random model's
    JSON has newlines, tabs and runs of spaces (checked below), so the pattern is what keeps them out."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    texts = {}
    for pattern in (None, " ?"):
        params = [constrained(seed, json=SCHEMA, whitespace_pattern=pattern) for seed in range(6)]
        outs = llm.generate(["{"] * 6, params)
        texts[pattern] = [out.outputs[0].text for out in outs]
    for out in outs:  # with the pattern: whole JSON values, which free whitespace often never finishes in 64 tokens
        check(out.outputs[0].text, out.outputs[0].finish_reason, dict(json=SCHEMA))
    free = "".join(texts[None])
    assert re.search(r"[\n\t\r]| {2}", free), texts[None]
    for text in texts[" ?"]:
        assert not re.search(r"[\n\t\r]| {2}", text), text
    assert any(" " in text for text in texts[" ?"]), texts[" ?"]  # the pattern allows one space, and it is used


@pytest.mark.parametrize("constraint, message", [
    (dict(regex="(["), "regex"),
    (dict(json={"type": "objectx"}), "objectx"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
    (dict(grammar="root ::= ("), "neither Lark nor GBNF"),
    (dict(grammar="root ::= undefined-rule"), "undefined-rule"),
    (dict(structural_tag={"triggers": ["<"], "structures": [{"begin": "<f>", "schema": {"type": "objectx"},
                                                             "end": "</f>"}]}), "objectx"),
    (dict(structural_tag={"triggers": ["<"], "structures": [{"begin": "<f>", "schema": {"x-guidance": 5},
                                                             "end": "</f>"}]}), "x-guidance"),
    (dict(json=SCHEMA, whitespace_pattern="[ "), "unclosed character class"),
])
def test_a_constraint_that_does_not_compile_is_refused_when_added(tiny_model_dir, constraint: dict,
                                                                  message: str) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match="structured_outputs") as err:
        llm.engine.add_request("hello", sp)
    assert message in str(err.value)
    if "grammar" in constraint or "regex" in constraint:  # the message names what was sent, not a JSON schema
        assert "JSON schema" not in str(err.value), err.value
    assert not llm.engine.has_unfinished()
    (out,) = llm.generate(["still serving"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


def test_tensor_parallel_gives_the_single_process_outputs(tiny_model_dir) -> None:
    model_dir = str(tiny_model_dir("qwen3"))
    kwargs = dict(device="cpu", num_kvcache_blocks=64, max_model_len=256)
    params = [constrained(i, **c) for i, c in enumerate(CONSTRAINTS)]
    prompts = [f"prompt {i}" for i in range(len(params))]
    single = [o.outputs[0].text for o in LLM(model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model_dir, tensor_parallel_size=2, async_scheduling=True, **kwargs)
    try:
        tp = [o.outputs[0].text for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    assert tp == single
    for text, c in zip(tp, CONSTRAINTS):
        check(text, "stop", c)


def test_a_constraint_compiles_once_and_its_cached_first_mask_is_a_fresh_matchers(tiny_model_dir) -> None:
    """Every request of a job usually repeats one schema: it compiles once, and the mask of the first token (the
    slowest, computed when the request is added) is what each new matcher would compute."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=32)
    compiler = llm.engine.admission.structured_outputs()
    for c in CONSTRAINTS:
        compiled = compiler.grammar(StructuredOutputsParams(**c))
        assert compiler.grammar(StructuredOutputsParams(**c)) is compiled
        state = compiler.new_state(compiled)
        fresh = torch.empty_like(compiled.first_mask)
        state.matcher.unsafe_compute_mask_ptr(fresh.data_ptr(), fresh.numel() * 4)
        assert torch.equal(fresh, compiled.first_mask)
        assert 0 < int(torch.count_nonzero(fresh)) < fresh.numel()  # some tokens allowed, not all
