"""Speculative decoding by prompt lookup (engine/spec_decode.py): the tokens are those of plain decoding.

Tiny random models fall into loops within a few tokens, so n-gram drafts are accepted on them; prompts of repeated
token patterns add matches from the prompt itself.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from nvcli import LLM, SamplingParams
from nvcli.config import ConfigError, EngineConfig
from nvcli.engine.protocol import EngineStats
from nvcli.engine.sequence import Sequence, SequenceStatus
from nvcli.engine.spec_decode import NgramProposer, propose_ngram
from nvcli.speculative import SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ENGINE = dict(device="cpu", num_kvcache_blocks=96, max_model_len=256)
REPEATS = [list(range(1000, 1013)) * 5, [5, 6, 7, 8] * 12 + [9], list(range(3000, 3007)) * 7 + [42]]
PLAIN = [list(range(2000, 2040)), list(range(4000, 4023)), list(range(6000, 6005))]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny qwen3 of 64 tokens: sampled at a low temperature its outputs repeat, so drafts get accepted."""
    from nvcli.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("spec") / "v64", "qwen3", vocab_size=64))


SMALL_PROMPTS = [[5, 6, 7, 8] * 12 + [9], list(range(10, 23)) * 5, list(range(30, 37)) * 7 + [42]]


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def run(model: str, prompts, params, spec: dict | None, **engine):
    llm = LLM(model, speculative_config=spec, **{**ENGINE, **engine})
    try:
        return llm.generate(prompts, params), llm.stats()
    finally:
        llm.shutdown()


_plain: dict[tuple, list] = {}


def plain_outputs(run_fn, model: str, prompts, params, **engine) -> list:
    """Plain decoding's outputs through `run_fn` (a test module's run(model, prompts, params, spec, **engine), which
    applies that module's engine defaults), computed once per session for each (run_fn, model, prompts, params,
    engine)."""
    key = (run_fn, model, repr(prompts), repr(params), repr(engine))
    if key not in _plain:
        _plain[key] = run_fn(model, prompts, params, None, **engine)[0]
    return _plain[key]


# ---------------------------------------------------------------------------------------------- the proposer
def test_propose_ngram_longest_most_recent_match() -> None:
    t = np.array([1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3], dtype=np.int64)
    # suffix "1 2 3" occurred at 0..2 (followed by 9 7 2 ...); "2 3" more recently at 5..6 but it is shorter
    assert propose_ngram(t, 3, 2, 4) == [9, 7, 2]
    assert propose_ngram(t, 3, 2, 2) == [8, 5, 1]  # at most 2-grams: the most recent "2 3"
    assert propose_ngram(t, 3, 4, 4) == []  # no earlier 4-gram match
    assert propose_ngram(np.array([4, 5, 6], dtype=np.int64), 3, 1, 3) == []


def test_propose_ngram_continues_a_loop() -> None:
    assert propose_ngram(np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int64), 4, 2, 4) == [3, 1, 2, 3]
    assert propose_ngram(np.array([7, 7, 7], dtype=np.int64), 3, 2, 4) == [7, 7, 7]


def test_proposer_stops_drafts_where_the_sequence_ends_and_before_sealed_page_ends() -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    seq = Sequence([1, 2, 3] * 4, SamplingParams(temperature=0, max_tokens=3), block_size=16)
    seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 11
    seq.token_ids.append(1)  # one output token; max_tokens 3 leaves 2 to sample, so 1 draft
    seq.num_computed_tokens = 12
    assert NgramProposer(cfg, 256, 16, False).propose([seq]) == {seq.seq_id: [2]}
    assert NgramProposer(cfg, 15, 16, False).propose([seq]) == {seq.seq_id: [2]}  # room: 15 - 13 - 1
    assert NgramProposer(cfg, 14, 16, False).propose([seq]) == {}
    seq.sampling_params = SamplingParams(temperature=0, max_tokens=30)
    assert NgramProposer(cfg, 256, 16, False).propose([seq]) == {seq.seq_id: [2, 3, 1, 2]}
    # 13 tokens: drafts at positions 13, 14; position 15 is the page's last slot (16-token pages)
    assert NgramProposer(cfg, 256, 16, True).propose([seq]) == {seq.seq_id: [2, 3]}
    seq.sampling_params = SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.5, min_tokens=20)
    assert NgramProposer(cfg, 256, 16, False).propose([seq]) == {seq.seq_id: [2, 3, 1, 2]}  # penalties, min_tokens
    seq.sampling_params = SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=1)
    assert NgramProposer(cfg, 256, 16, False).propose([seq]) == {seq.seq_id: [2, 3, 1, 2]}  # its prompt is scored


# ---------------------------------------------------------------------------------------------- the flag
@pytest.mark.parametrize("value, match", [
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
    ('{"method": "ngram", "model": "/models/draft", "num_speculative_tokens": 2}', "method ngram takes no model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "a draft model is"),
    ('{"model": "/models/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "go with method ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "must not exceed"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}', "disable_by_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key"),
    ("{not json", "not valid JSON"),
    ("[4]", "must be a JSON object"),
])
def test_bad_speculative_config_names_the_flag(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=f"--speculative-config: .*{match}"):
        EngineConfig(speculative_config=value)


def test_speculative_config_defaults_as_vllm() -> None:
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative_config
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.k) == (5, 5, 3)
    c = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    config = EngineConfig(speculative_config=SPEC)
    assert dataclasses.replace(config).speculative_config == config.speculative_config


def test_cli_rejects_a_bad_speculative_config(tmp_path) -> None:
    from typer.testing import CliRunner

    from nvcli.cli import app

    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    r = CliRunner().invoke(app, ["generate", str(tmp_path / "in.jsonl"), "--speculative-config",
                                 '{"model": "draft", "num_speculative_tokens": 2}'])
    assert r.exit_code == 2 and "--speculative-config: draft model 'draft'" in r.output  # no such directory
    r = CliRunner().invoke(app, ["bench", "--speculative-config", '{"method": "ngram"}'])
    assert r.exit_code == 2 and "--speculative-config" in r.output


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("case", ["repeats", "plain", "prefix_caching", "preemption", "chunked_prefill", "async"])
def test_greedy_tokens_are_those_of_plain_decoding(tiny_model_dir, case: str) -> None:
    model = str(tiny_model_dir("qwen3"))
    prompts, params, engine = REPEATS, GREEDY, {}
    if case == "plain":
        prompts = PLAIN
    elif case == "prefix_caching":  # the same prompts twice, and two completions each: cached blocks are read back
        prompts, params = REPEATS + REPEATS[:1], dataclasses.replace(GREEDY, n=2, max_tokens=24)
    elif case == "preemption":  # 12 blocks of 16 tokens for 3 sequences of up to 99 tokens
        engine = dict(num_kvcache_blocks=12, max_model_len=192)
    elif case == "chunked_prefill":  # 8-token steps: prompt chunks beside verify rows cut to the budget
        engine = dict(max_num_batched_tokens=8, enable_prefix_caching=False)
    elif case == "async":
        engine = dict(async_scheduling=True)
    ref, _ = run(model, prompts, params, None, **engine)
    out, stats = run(model, prompts, params, {**SPEC, "disable_by_batch_size": 16}, **engine)
    assert tokens(out) == tokens(ref)
    assert [[c.finish_reason for c in o.outputs] for o in out] == [[c.finish_reason for c in o.outputs] for o in ref]
    assert stats.spec_accepted_tokens > 0 and stats.spec_verify_rows > 0
    assert stats.spec_accepted_tokens <= stats.spec_draft_tokens <= 4 * stats.spec_verify_rows
    assert stats.generation_tokens == sum(len(t) for o in tokens(out) for t in o)
    if case == "preemption":
        assert stats.num_preemptions > 0
    if case == "prefix_caching":
        assert stats.prefix_cache_hit_tokens > 0


def test_stops_cut_a_verify_row(tiny_model_dir) -> None:
    """EOS-like stop ids, stop strings and max_tokens end a sequence inside a verify row's accepted tokens."""
    model = str(tiny_model_dir("qwen3"))
    ref, _ = run(model, REPEATS, GREEDY, None)
    stop_ids = [t[0][9] for t in tokens(ref)]  # a token of each output, likely inside a verify row
    params = [dataclasses.replace(GREEDY, stop_token_ids=[stop_ids[0]]), dataclasses.replace(GREEDY, max_tokens=13),
              dataclasses.replace(GREEDY, stop_token_ids=[stop_ids[2]], include_stop_str_in_output=True)]
    ref, _ = run(model, REPEATS, params, None)
    out, stats = run(model, REPEATS, params, SPEC)
    assert tokens(out) == tokens(ref) and stats.spec_accepted_tokens > 0
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in ref]
    assert [o.outputs[0].finish_reason for o in out] == ["stop", "length", "stop"]


def test_tp2_over_gloo_gives_tp1_tokens(tiny_model_dir) -> None:
    model = str(tiny_model_dir("qwen3"))
    ref, _ = run(model, REPEATS, GREEDY, None)
    out, stats = run(model, REPEATS, GREEDY, SPEC, tensor_parallel_size=2, async_scheduling=True)
    assert tokens(out) == tokens(ref) and stats.spec_accepted_tokens > 0


def test_seeded_sampled_requests_get_the_same_tokens(small_vocab_model: str) -> None:
    """A seeded row's draw depends on its seed and output position only: speculation does not change it."""
    params = [SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=40, ignore_eos=True)
              for t, k, s in ((0.3, -1, 1), (0.3, 20, 2), (0.2, -1, 3))]
    ref, _ = run(small_vocab_model, SMALL_PROMPTS, params, None)
    out, stats = run(small_vocab_model, SMALL_PROMPTS, params, SPEC)
    assert tokens(out) == tokens(ref) and stats.spec_accepted_tokens > 0


def test_seeded_sampled_requests_get_the_same_logprobs(small_vocab_model: str) -> None:
    """Logprobs are the model's own (untempered) at each position, whichever row of a verify step sampled it."""
    params = [SamplingParams(temperature=0.3, seed=s, max_tokens=40, ignore_eos=True, logprobs=n)
              for s, n in ((1, 5), (2, 0), (3, 2))]
    ref, _ = run(small_vocab_model, SMALL_PROMPTS, params, None)
    out, stats = run(small_vocab_model, SMALL_PROMPTS, params, SPEC)
    assert tokens(out) == tokens(ref) and stats.spec_accepted_tokens > 0
    assert_same_logprobs(out, ref)


def test_prompt_logprobs_and_penalized_rows_decode_beside_plain_ones(tiny_model_dir) -> None:
    model = str(tiny_model_dir("qwen3"))
    params = [GREEDY, dataclasses.replace(GREEDY, prompt_logprobs=2), dataclasses.replace(GREEDY, repetition_penalty=1.3)]
    ref, _ = run(model, REPEATS, params, None)
    out, stats = run(model, REPEATS, params, SPEC)
    assert tokens(out) == tokens(ref) and stats.spec_accepted_tokens > 0
    assert [len(o.prompt_logprobs or ()) for o in out] == [0, len(REPEATS[1]), 0]


# ---------------------------------------------------------------------------------------------- logprobs
LOGPROB_TOL = 1e-5  # float32 on the CPU: a verify row's forward has 1 + k query rows, so it rounds otherwise


def assert_same_logprobs(out, ref) -> None:
    """Each completion's logprobs are those of `ref`: per position the same entries in the same order (the sampled
    token first, then the top alternatives), the same ranks and texts, and logprobs within LOGPROB_TOL. Not
    bitwise: a verify step computes a position's logits in a forward of more query rows than a plain decode step
    (observed differences ~2e-6)."""
    for o, r in zip(out, ref, strict=True):
        for c, d in zip(o.outputs, r.outputs, strict=True):
            assert (c.logprobs is None) == (d.logprobs is None)
            if d.logprobs is None:
                continue
            assert len(c.logprobs) == len(d.logprobs) == len(d.token_ids)
            for token, p, q in zip(d.token_ids, c.logprobs, d.logprobs):
                assert p is not None and q is not None and next(iter(p)) == token
                assert [(t, v.rank, v.decoded_token) for t, v in p.items()] == \
                    [(t, v.rank, v.decoded_token) for t, v in q.items()]
                assert max(abs(v.logprob - q[t].logprob) for t, v in p.items()) <= LOGPROB_TOL
            assert c.cumulative_logprob == pytest.approx(d.cumulative_logprob, abs=LOGPROB_TOL * len(d.token_ids))


@pytest.mark.parametrize("case", ["mixed", "prefix_caching_preemption"])
def test_rows_with_logprobs_speculate_and_report_plain_decodings_logprobs(tiny_model_dir, case: str) -> None:
    """Every token a verify step appends carries the logprobs of its position: the chosen token's logprob and rank
    and the top alternatives, as plain decoding reports them."""
    model = str(tiny_model_dir("qwen3"))
    # beside each other: top 5 alternatives, the chosen token only, no logprobs (rows of one verify step interleave)
    prompts, engine = REPEATS, {}
    params: list[SamplingParams] | SamplingParams = [dataclasses.replace(GREEDY, logprobs=5),
                                                     dataclasses.replace(GREEDY, logprobs=0), GREEDY]
    if case == "prefix_caching_preemption":  # a prompt twice, two completions each, in 12 blocks of 16 tokens
        prompts, params = REPEATS + REPEATS[:1], dataclasses.replace(GREEDY, logprobs=3, n=2)
        engine = dict(num_kvcache_blocks=12, max_model_len=192)
    ref, _ = run(model, prompts, params, None, **engine)
    out, stats = run(model, prompts, params, {**SPEC, "disable_by_batch_size": 16}, **engine)
    assert tokens(out) == tokens(ref) and stats.spec_accepted_tokens > 0
    assert_same_logprobs(out, ref)
    if case == "mixed":
        assert [[len(p) for p in o.outputs[0].logprobs or ()][:1] for o in out] == [[5], [1], []]  # greedy: top-1 is the token
    else:
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0


def test_no_speculation_above_disable_by_batch_size(tiny_model_dir) -> None:
    model = str(tiny_model_dir("qwen3"))
    params = [dataclasses.replace(GREEDY, max_tokens=8), dataclasses.replace(GREEDY, max_tokens=8), GREEDY]
    _, stats = run(model, REPEATS, params, {**SPEC, "disable_by_batch_size": 2})
    assert stats.spec_verify_rows > 0  # once the first two have finished
    _, stats = run(model, REPEATS, dataclasses.replace(GREEDY, max_tokens=8), {**SPEC, "disable_by_batch_size": 2})
    assert stats.spec_verify_rows == 0  # three sequences, all finishing together


def test_unseeded_sampling_keeps_the_target_distribution(small_vocab_model: str) -> None:
    """Two-sample chi-square tests, one per output position 1..5 (sampled in verify rows, after accepted or rejected
    drafts): 400 unseeded completions of one prompt with and without speculation (engine seeds differ)."""
    params = SamplingParams(temperature=0.3, max_tokens=6, ignore_eos=True, n=400)
    engine = dict(num_kvcache_blocks=400, max_num_seqs=400)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 400}
    samples = []
    for s, seed in ((None, 1), (spec, 2)):
        out, stats = run(small_vocab_model, SMALL_PROMPTS[:1], params, s, seed=seed, **engine)
        samples.append(np.array([c.token_ids for c in out[0].outputs]))  # [400, 6]
    assert stats.spec_accepted_tokens > 50
    for pos in range(1, 6):
        a, b = (np.bincount(x[:, pos], minlength=64) for x in samples)
        assert _two_sample_chi2_p(a, b) > 1e-3 / 5, (pos, a, b)  # Bonferroni over the 5 positions


def _two_sample_chi2_p(a: np.ndarray, b: np.ndarray, min_count: int = 10) -> float:
    """p-value of "a and b are counts of one distribution"; categories seen fewer than min_count times pooled."""
    keep = (a + b) >= min_count
    a, b = np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())
    total = a + b
    used = total > 0
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = float((((a - ea) ** 2 / ea)[used] + ((b - eb) ** 2 / eb)[used]).sum())
    df = int(used.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_dashboard_shows_acceptance() -> None:
    from nvcli.dashboard import spec_decode

    stats = EngineStats(1, 0, 0, 10, 2, 0, 0, 5, 9, 4, 0.01, 0)
    assert spec_decode(stats) is None
    stats = dataclasses.replace(stats, spec_draft_tokens=40, spec_accepted_tokens=30, spec_verify_rows=10)
    assert spec_decode(stats) == "accepted 30 / 40 drafts (75%), 4.00 tokens per verify"
    assert math.isclose(1 + stats.spec_accepted_tokens / stats.spec_verify_rows, 4.0)


@pytest.mark.parametrize("spec, want", [(None, 3), ({"method": "ngram", "num_speculative_tokens": 4}, 15)])
def test_kv_sizing_samples_as_many_rows_as_a_step_can(tiny_model_dir, monkeypatch, spec, want: int) -> None:
    """The KV-sizing profile samples with every feature on as many rows as a step samples (max_num_seqs, or a
    verify step's 1 + k rows for each of disable_by_batch_size sequences), not just its prefill's few sequences:
    their logits and sampling scratch must fit beside the KV cache."""
    from nvcli.engine import kv_sizing

    llm = LLM(str(tiny_model_dir("qwen3")), speculative_config=spec, **{**ENGINE, "max_num_seqs": 3})
    runner = llm.engine.executor.runner
    assert kv_sizing.most_sampled_rows(runner.config) == want
    sampled = []
    real = kv_sizing.sample_worst_case
    monkeypatch.setattr(kv_sizing, "sample_worst_case",
                        lambda r, logits, **kw: (sampled.append(logits.shape[0]), real(r, logits, **kw)))
    kv_sizing.profile_run(runner, worst_case=True)  # its largest prefill is one sequence of 256 tokens
    assert sampled == [want]
