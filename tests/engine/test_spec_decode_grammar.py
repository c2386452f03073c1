"""Speculative decoding of constrained rows and of prompt_logprobs rows (engine/spec_decode.py): a verify row's
position i is masked with the grammar matcher's mask after the drafts before it (GrammarCompiler.step_mask), the
matcher takes only the kept tokens, and the tokens (and logprobs, prompt_logprobs) are those of plain decoding, with
n-gram drafts and with a draft model."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import pytest
import torch
from test_spec_decode import (  # noqa: F401  (small_vocab_model: a fixture)
    GREEDY,
    SMALL_PROMPTS,
    SPEC,
    assert_same_logprobs,
    plain_outputs,
    small_vocab_model,
    tokens,
)

from nvcli import LLM, SamplingParams, StructuredOutputsParams
from nvcli.engine.scheduler import PENDING, ScheduledBatch
from nvcli.engine.sequence import Sequence, SequenceStatus
from nvcli.engine.spec_decode import NgramProposer
from nvcli.engine.structured_output import GrammarCompiler
from nvcli.speculative import SpeculativeConfig
from nvcli.testing.tiny_models import QWEN3_EOS, QWEN_VOCAB

# JSON arrays of "ab" / "cd" (the greedy tiny model loops in them, and a seeded one flips between the two: n-gram
# drafts get accepted and rejected), strings of at most 30 characters (the model's own loops, cut by the length),
# pairs by a regex, a choice that ends after its 10th token, and a loose regex (a draft model's unconstrained
# favourite is often allowed, so some of its drafts are accepted).
ENUMS = {"type": "array", "items": {"enum": ["ab", "cd"]}, "minItems": 6, "maxItems": 12}
STRINGS = {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 2, "maxItems": 4}
PAIRS = r"(ab|cd)( (ab|cd)){6,20}\."
WORDS = r"[A-Za-z ]{1,60}\."
CHOICE = ["ab ab ab ab ab ab ab ab", "ab ab ab ab cd cd cd cd", "ab ab cd ab ab cd ab ab"]
HEAD = "the list again and again: "  # 6 tokens: the repeated JSON prompt below fills a block (16 tokens) to cache


def constraint(**c) -> StructuredOutputsParams:
    return StructuredOutputsParams(disable_any_whitespace=True, **c)


def greedy(c: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=32, structured_outputs=c, **kw)


def seeded(c: StructuredOutputsParams, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=32, structured_outputs=c)


# (prompt, params): the first prompt comes three times, once with two completions and logprobs (its first block then
# comes from the prefix cache); 12 blocks of 16 tokens for 9 sequences of up to 51 tokens make the scheduler preempt
REQUESTS = [
    (HEAD + '["ab","ab","cd","ab","ab","cd"', greedy(constraint(json=ENUMS))),
    (HEAD + '["ab","ab","cd","ab","ab","cd"', greedy(constraint(json=ENUMS), n=2, logprobs=2)),
    (HEAD + "ab ab cd ab ab cd ab", greedy(constraint(regex=PAIRS))),
    (HEAD + "ab ab ab ab ab ab ab ab", greedy(constraint(choice=CHOICE))),
    (HEAD + '["ab","ab","cd","ab","ab","cd"', greedy(constraint(json=STRINGS))),
    (HEAD + "hello world hello world", greedy(constraint(regex=WORDS))),
    (HEAD + "ab cd ab cd", seeded(constraint(regex=PAIRS), 5)),
    (HEAD + "x", seeded(constraint(json=ENUMS), 7)),
]
PROMPTS = [p for p, _ in REQUESTS]
PARAMS = [sp for _, sp in REQUESTS]
ENGINE = dict(device="cpu", max_model_len=192, num_kvcache_blocks=12)


def run(model: str, prompts, params, spec: dict | None, **engine):
    """Outputs, stats, per request (drafts verified, drafts accepted, drafts accepted after a preemption of a
    sequence whose prompt_logprobs were all scored before it: its prompt was recomputed without them), and the
    number of steps that scored prompt positions beside verify rows."""
    llm = LLM(model, speculative_config=spec, **{**ENGINE, **engine})
    drafted: Counter[str] = Counter()
    accepted: Counter[str] = Counter()
    recomputed: Counter[str] = Counter()
    scored_then_preempted: set[int] = set()
    scoring_beside_verify = 0
    scheduler = llm.engine.scheduler
    accept, preempt, schedule = scheduler._accept, scheduler._preempt, scheduler.schedule

    def recording_schedule(drafts: dict[int, list[int]] | None = None) -> ScheduledBatch:
        nonlocal scoring_beside_verify
        batch = schedule(drafts)
        scoring_beside_verify += bool(batch.prompt_logit_spans and any(batch.num_drafts))
        return batch

    def recording_accept(seq: Sequence, index: int, samples: list[int]) -> int:
        n = accept(seq, index, samples)
        drafted[seq.request_id] += len(samples) - 1
        accepted[seq.request_id] += n
        if seq.seq_id in scored_then_preempted:
            recomputed[seq.request_id] += n
        return n

    def recording_preempt(seq: Sequence) -> None:
        if 0 < seq.num_prompt_logprobs_wanted == seq.num_prompt_logprobs_scheduled:
            scored_then_preempted.add(seq.seq_id)
        preempt(seq)

    scheduler._accept = recording_accept  # type: ignore[method-assign]
    scheduler._preempt = recording_preempt  # type: ignore[method-assign]
    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    try:
        outs = llm.generate(prompts, params)
        per_request = [(drafted[o.request_id], accepted[o.request_id], recomputed[o.request_id]) for o in outs]
        return outs, llm.stats(), per_request, scoring_beside_verify
    finally:
        llm.shutdown()


def assert_follows(text: str, finish_reason: str, c: StructuredOutputsParams) -> None:
    """An output that finished is what its constraint accepts (one cut by max_tokens is only compared with plain
    decoding's)."""
    if finish_reason != "stop":
        assert finish_reason == "length"
        return
    if c.json == ENUMS:
        value = json.loads(text)
        assert 6 <= len(value) <= 12 and set(value) <= {"ab", "cd"}, text
    elif c.json == STRINGS:
        value = json.loads(text)
        assert 2 <= len(value) <= 4 and all(isinstance(s, str) and len(s) <= 30 for s in value), text
    elif c.regex is not None:
        assert re.fullmatch(c.regex, text), text
    else:
        assert text in CHOICE, text


# ---------------------------------------------------------------------------------------------- the masks
@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> GrammarCompiler:
    from nvcli.models.tokenizer import load_tokenizer

    return GrammarCompiler(load_tokenizer(tiny_model_dir("qwen3")), QWEN_VOCAB, {QWEN3_EOS})


ARRAY = [1183, 370, 2198, 4385, 2198, 370, 2198, 370, 2198, 4385, 2198, 370, 1341]  # '["ab","cd","ab","ab","cd","ab"]'
THINK_END = 151668  # </think>
REFUSED = 9999  # "_mask": never allowed in ENUMS after '["ab'


def test_verify_rows_are_masked_by_the_matcher_after_the_drafts_before_them(compiler: GrammarCompiler) -> None:
    """Each position of a verify row gets the mask a matcher fed the sequence's tokens and the drafts before it
    would compute; positions after a refused draft, or after the grammar's EOS, are all ones (nothing sampled there
    is kept); positions still reasoning are unmasked. The matchers are left as they were."""
    grammar = compiler.grammar(constraint(json=ENUMS))

    def seq(output: list[int], drafts: list[int], reasoning: bool = False) -> Sequence:
        s = Sequence([1, 2, 3], SamplingParams(), block_size=16)
        s.status = SequenceStatus.RUNNING
        s.grammar = compiler.new_state(grammar, THINK_END if reasoning else None)
        for t in output:
            compiler.consume(s.grammar, t)
        s.token_ids += output + drafts + [PENDING]
        return s

    plain = seq(ARRAY[:2], [])
    valid = seq(ARRAY[:2], ARRAY[2:5])
    refused = seq(ARRAY[:2], [ARRAY[2], REFUSED, ARRAY[3]])
    ending = seq(ARRAY[:11], ARRAY[11:] + [QWEN3_EOS, 5])  # the array closes at the 2nd draft, then EOS, then "&"
    thinking = seq([], [5, THINK_END, ARRAY[0], ARRAY[1]], reasoning=True)  # constrained after </think>
    still = seq([], [5, 6], reasoning=True)  # no </think>: free throughout
    unconstrained = seq([], [7, 8])
    unconstrained.grammar = None
    seqs = [plain, valid, refused, ending, thinking, still, unconstrained]
    states = [s.grammar for s in seqs if s.grammar is not None]
    before = [(g.consumed, g.fed) for g in states]

    out = compiler.step_mask(seqs, [len(s.token_ids) - 1 for s in seqs], [0, 3, 3, 4, 4, 2, 2])
    assert out is not None
    rows, mask = out
    # own rows 0..6, then the extra rows: valid 7-9, refused 10-12, ending 13-16, thinking 17-20, still 21-22, ...
    want_tokens = {0: ARRAY[:2], 7: ARRAY[:2], 8: ARRAY[:3], 9: ARRAY[:4], 1: ARRAY[:5],
                   10: ARRAY[:2], 11: ARRAY[:3], 12: None, 2: None,
                   13: ARRAY[:11], 14: ARRAY[:12], 15: ARRAY, 16: None, 3: None,
                   19: [], 20: ARRAY[:1], 4: ARRAY[:2]}
    assert sorted(rows) == sorted(want_tokens)
    words = compiler.mask_words
    for row, fed in want_tokens.items():
        got = mask[rows.index(row)]
        if fed is None:
            assert torch.equal(got, torch.full((words,), -1, dtype=torch.int32)), row
            continue
        fresh = compiler.new_state(grammar)
        for t in fed:
            compiler.consume(fresh, t)
        want = torch.empty(words, dtype=torch.int32)
        fresh.matcher.unsafe_compute_mask_ptr(want.data_ptr(), words * 4)
        assert torch.equal(got, want), row
    eos_only = torch.zeros(words, dtype=torch.int32)
    eos_only[QWEN3_EOS // 32] = 1 << QWEN3_EOS % 32
    assert torch.equal(mask[rows.index(15)], eos_only)  # the grammar is complete
    # nothing was consumed for good: each matcher still computes its own first position's mask
    assert before == [(g.consumed, g.fed) for g in states]
    for s, row in ((plain, 0), (valid, 7), (refused, 10), (ending, 13)):
        again = torch.empty(words, dtype=torch.int32)
        s.grammar.matcher.unsafe_compute_mask_ptr(again.data_ptr(), words * 4)
        assert torch.equal(again, mask[rows.index(row)]) and not s.grammar.is_done


def test_drafts_are_cut_before_the_first_token_the_grammar_refuses(compiler: GrammarCompiler) -> None:
    state = compiler.new_state(compiler.grammar(constraint(json=ENUMS)))
    for t in ARRAY[:2]:
        compiler.consume(state, t)
    assert state.allowed_prefix(ARRAY[2:] + [QWEN3_EOS, 5]) == len(ARRAY) - 2 + 1  # up to the EOS that ends it
    assert state.allowed_prefix([ARRAY[2], REFUSED, ARRAY[3]]) == 1
    thinking = compiler.new_state(compiler.grammar(constraint(json=ENUMS)), THINK_END)
    assert thinking.allowed_prefix([REFUSED, 5]) == 2  # still reasoning: free
    assert thinking.allowed_prefix([REFUSED, THINK_END, ARRAY[0], REFUSED]) == 3
    assert state.consumed == state.fed == 2 and thinking.reasoning_end == THINK_END  # nothing consumed
    fresh = compiler.new_state(compiler.grammar(constraint(json=ENUMS)))
    for t in ARRAY[:2]:
        compiler.consume(fresh, t)
    masks = torch.empty((2, compiler.mask_words), dtype=torch.int32)
    for row, matcher in enumerate((state.matcher, fresh.matcher)):
        matcher.unsafe_compute_mask_ptr(masks[row].data_ptr(), compiler.mask_words * 4)
    assert torch.equal(masks[0], masks[1])  # the matcher is where it was


def test_ngram_drafts_of_a_constrained_row_stop_before_the_first_refused_one(compiler: GrammarCompiler) -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    # the output '["ab","ab' ends with the prompt's first 3 tokens, which are followed by '","', 'cd', "_mask", ...
    seq = Sequence([370, 2198, 370, 2198, 4385, REFUSED, 7, 8], SamplingParams(temperature=0, max_tokens=30),
                   block_size=16)
    seq.token_ids += [1183, 370, 2198, 370]
    seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, seq.num_tokens - 1
    assert NgramProposer(cfg, 256, 16, False).propose([seq]) == {seq.seq_id: [2198, 4385, REFUSED, 7]}
    seq.grammar = compiler.new_state(compiler.grammar(constraint(json=ENUMS)))
    for t in seq.completion_token_ids:
        compiler.consume(seq.grammar, t)
    assert NgramProposer(cfg, 256, 16, False).propose([seq]) == {seq.seq_id: [2198, 4385]}


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("case", ["ngram", "ngram_async", "draft_model"])
def test_constrained_rows_give_plain_decodings_tokens(tiny_model_dir, case: str) -> None:
    """Greedy rows under JSON schemas, regexes and a choice get plain decoding's tokens, finish reasons and
    (constrained) logprobs, and seeded sampled rows the same draws, under preemption and prefix caching; each output
    is what its constraint accepts. Drafts are accepted and rejected. The draft model is the target itself: its
    drafts follow each row's grammar (a copy of the matcher runs ahead over them), so a greedy row's drafts are
    exactly the target's constrained choices and every one is kept up to the sequence's end; the seeded row rejects
    some."""
    model = str(tiny_model_dir("qwen3"))
    prompts, params, engine = PROMPTS, PARAMS, {}
    if case == "draft_model":  # fewer rows (the draft's eager forwards are slow on the CPU), in fewer blocks
        prompts, params = [PROMPTS[i] for i in (3, 4, 5, 6)], [PARAMS[i] for i in (3, 4, 5, 6)]
        engine = dict(num_kvcache_blocks=6, max_model_len=96)
    ref = plain_outputs(run, model, prompts, params, **engine)
    spec = ({**SPEC, "disable_by_batch_size": 16} if case.startswith("ngram")
            else {"model": model, "num_speculative_tokens": 4, "disable_by_batch_size": 16})
    out, stats, per_request, _ = run(model, prompts, params, spec, async_scheduling=case == "ngram_async", **engine)
    assert tokens(out) == tokens(ref)
    assert [[c.finish_reason for c in o.outputs] for o in out] == [[c.finish_reason for c in o.outputs] for o in ref]
    assert_same_logprobs(out, ref)
    for o, sp in zip(out, params):
        for c in o.outputs:
            assert_follows(c.text, c.finish_reason, sp.structured_outputs)
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert sum(a for _, a, _ in per_request) == stats.spec_accepted_tokens
    assert stats.num_preemptions > 0
    if case == "draft_model":
        greedy_rows = [r for r, sp in zip(per_request, params) if sp.temperature == 0]
        # every draft kept but those past the end of a sequence (its last verify may draft beyond its EOS)
        assert greedy_rows and all(0 < a and d - a < 4 for d, a, _ in greedy_rows), per_request
    if case.startswith("ngram"):
        assert all(a > 0 for _, a, _ in per_request), per_request  # every request verified drafts and accepted some
        assert any(a < d for d, a, _ in per_request[-2:]), per_request  # the seeded rows: some rejected
        assert stats.prefix_cache_hit_tokens > 0


# ---------------------------------------------------------------------------------------------- prompt_logprobs
def assert_same_prompt_logprobs(out, ref) -> None:
    for o, r in zip(out, ref, strict=True):
        assert (o.prompt_logprobs is None) == (r.prompt_logprobs is None)
        if r.prompt_logprobs is None:
            continue
        assert len(o.prompt_logprobs) == len(r.prompt_logprobs) == len(r.prompt_token_ids)
        assert o.prompt_logprobs[0] is None and r.prompt_logprobs[0] is None
        for p, q in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]):
            assert [(t, v.rank) for t, v in p.items()] == [(t, v.rank) for t, v in q.items()]
            assert max(abs(v.logprob - q[t].logprob) for t, v in p.items()) <= 1e-5


@pytest.mark.parametrize("case", ["preemption", "chunked_prefill_async"])
def test_prompt_logprobs_rows_speculate(small_vocab_model: str, case: str) -> None:  # noqa: F811
    """Rows with prompt_logprobs (greedy, and seeded with logprobs, beside a row without) verify drafts once their
    prompt is done and get plain decoding's tokens, logprobs and prompt logprobs, also where the prompt is recomputed
    after a preemption (its positions are not scored twice); with chunked prefill, prompts are scored a chunk at a
    time in the steps that verify other rows' drafts."""
    params = [dataclasses.replace(GREEDY, max_tokens=32, prompt_logprobs=3),
              SamplingParams(temperature=0.3, seed=2, max_tokens=32, ignore_eos=True, prompt_logprobs=0, logprobs=1),
              dataclasses.replace(GREEDY, max_tokens=32),
              dataclasses.replace(GREEDY, max_tokens=32, prompt_logprobs=1)]
    prompts = SMALL_PROMPTS + SMALL_PROMPTS[:1]
    engine = dict(num_kvcache_blocks=9, max_model_len=144)  # 4 sequences of up to 97 tokens: 2-3 preempted
    if case == "chunked_prefill_async":
        engine.update(max_num_batched_tokens=16, async_scheduling=True)
    ref = plain_outputs(run, small_vocab_model, prompts, params, **engine)
    out, stats, per_request, scoring_beside_verify = run(small_vocab_model, prompts, params,
                                                         {**SPEC, "disable_by_batch_size": 16}, **engine)
    assert tokens(out) == tokens(ref)
    assert_same_prompt_logprobs(out, ref)
    assert_same_logprobs(out, ref)
    assert [len(o.prompt_logprobs or ()) for o in out] == [len(p) if sp.prompt_logprobs is not None else 0
                                                           for p, sp in zip(prompts, params)]
    assert all(a > 0 for _, a, _ in per_request), per_request
    # a prompt_logprobs row preempted after its prompt was scored accepted drafts after its recompute
    assert any(r > 0 for _, _, r in per_request), per_request
    assert stats.num_preemptions > 0
    if case == "chunked_prefill_async":
        assert scoring_beside_verify > 0
