"""Speculative decoding with a draft model (engine/draft_model.py): the tokens are those of plain decoding, and the
drafts are the draft model's own greedy continuations (its paged KV kept right across verify steps, preemption,
prefix caching and chunked prefill).

Drafts: the target itself (every draft accepted), the target with noise on its weights (some accepted: the kept and
dropped tentative KV both happen), an unrelated random model (none accepted).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_spec_decode import (  # the n-gram tests' prompts, settings and helpers (tests/engine is on sys.path)
    ENGINE,
    GREEDY,
    PLAIN,
    REPEATS,
    SMALL_PROMPTS,
    _two_sample_chi2_p,
    assert_same_logprobs,
    tokens,
)

from nvcli import LLM, SamplingParams
from nvcli.config import ConfigError, EngineConfig
from nvcli.engine.draft_model import DraftProposer

K = 4


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny qwen3 of 64 tokens: sampled at a low temperature, its greedy drafts are often accepted."""
    from nvcli.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("draft") / "v64", "qwen3", vocab_size=64))


def noisy_copy(src: Path, dst: Path, scale: float) -> Path:
    """`src`'s checkpoint with Gaussian noise of `scale` times each tensor's spread: a draft that mostly agrees."""
    from safetensors.torch import load_file, save_file

    if not (dst / "model.safetensors").exists():
        shutil.copytree(src, dst, dirs_exist_ok=True)
        weights = load_file(dst / "model.safetensors")
        g = torch.Generator().manual_seed(7)
        weights = {k: v + scale * torch.randn(v.shape, generator=g) * v.std() for k, v in weights.items()}
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from nvcli.testing.tiny_models import make_tiny_model

    target = tiny_model_dir("qwen3")
    root = tmp_path_factory.mktemp("drafts")
    return {"target": str(target), "same": str(target), "near": str(noisy_copy(target, root / "near", 0.1)),
            "other": str(make_tiny_model(root / "other", "qwen3", seed=1))}


def spec(draft: str, **extra: object) -> dict:
    return {"model": draft, "num_speculative_tokens": K, **extra}


def run(model: str, prompts, params, spec: dict | None, record: list | None = None, **engine):
    """Outputs and stats; with `record`, every verify row's (context, drafts) is appended to it."""
    llm = LLM(model, speculative_config=spec, **{**ENGINE, **engine})
    try:
        if record is not None:
            proposer = llm.engine.proposer
            assert isinstance(proposer, DraftProposer)
            fill = proposer.fill

            def recording_fill(batch) -> None:
                fill(batch)
                for seq, k, index in zip(batch.seqs, batch.num_drafts, batch.sample_index):
                    if k:
                        record.append((seq.token_ids[: index - k], seq.token_ids[index - k : index]))

            proposer.fill = recording_fill  # type: ignore[method-assign]
        return llm.generate(prompts, params), llm.stats()
    finally:
        llm.shutdown()


def assert_drafts_are_greedy_continuations(draft: str, record: list) -> None:
    """Each recorded draft is what plain greedy decoding of the draft model gives after its context."""
    assert record
    contexts = [{"prompt_token_ids": c} for c, _ in record]
    outs = LLM(draft, **ENGINE).generate(contexts, [dataclasses.replace(GREEDY, max_tokens=len(d)) for _, d in record])
    assert [o.outputs[0].token_ids for o in outs] == [d for _, d in record]


@pytest.mark.parametrize("draft, case", [("same", "repeats"), ("other", "plain"),
                                         ("near", "prefix_caching"), ("near", "preemption"),
                                         ("same", "preemption"), ("near", "chunked_prefill")])
def test_greedy_tokens_are_those_of_plain_decoding(drafts: dict[str, str], draft: str, case: str) -> None:
    model = drafts["target"]
    prompts, params, engine = PLAIN + REPEATS[:1], GREEDY, {}
    if case == "repeats":
        prompts = REPEATS
    elif case == "prefix_caching":  # the same prompt twice, and two completions each: cached blocks read back
        prompts, params = REPEATS[:1] + PLAIN[:1] + REPEATS[:1], dataclasses.replace(GREEDY, n=2, max_tokens=24)
    elif case == "preemption":  # 12 blocks of 16 tokens for 4 sequences of up to 105 tokens
        engine = dict(num_kvcache_blocks=12, max_model_len=192)
    elif case == "chunked_prefill":  # 8-token steps: the draft catches up on prompts a chunk at a time
        engine = dict(max_num_batched_tokens=8, enable_prefix_caching=False)
    ref, _ = run(model, prompts, params, None, **engine)
    record: list = []
    out, stats = run(model, prompts, params, spec(drafts[draft], disable_by_batch_size=16), record, **engine)
    assert tokens(out) == tokens(ref)
    assert [[c.finish_reason for c in o.outputs] for o in out] == [[c.finish_reason for c in o.outputs] for o in ref]
    assert stats.spec_verify_rows > 0 and stats.spec_draft_tokens <= K * stats.spec_verify_rows
    assert stats.generation_tokens == sum(len(t) for o in tokens(out) for t in o)
    if draft == "same":
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens  # the draft's KV is right wherever it reads
    elif draft == "near":
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    else:
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens // 4
    if case == "preemption":
        assert stats.num_preemptions > 0
    if case == "prefix_caching":
        assert stats.prefix_cache_hit_tokens > 0
    if draft != "same":
        assert_drafts_are_greedy_continuations(drafts[draft], record[:: max(1, len(record) // 40)])


def test_rows_with_logprobs_report_plain_decodings_logprobs(drafts: dict[str, str]) -> None:
    """A draft that mostly agrees (accepted and rejected drafts both happen), under preemption: each appended token's
    logprobs are those plain decoding reports at its position."""
    params = [dataclasses.replace(GREEDY, logprobs=5), dataclasses.replace(GREEDY, logprobs=0), GREEDY]
    engine = dict(num_kvcache_blocks=12, max_model_len=192)
    ref, _ = run(drafts["target"], REPEATS, params, None, **engine)
    out, stats = run(drafts["target"], REPEATS, params, spec(drafts["near"], disable_by_batch_size=16), **engine)
    assert tokens(out) == tokens(ref) and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.num_preemptions > 0
    assert_same_logprobs(out, ref)


def test_seeded_sampled_requests_get_the_same_tokens(small_vocab_model: str) -> None:
    """Greedy drafts, sampled targets: a seeded row's draws are those of plain decoding."""
    params = [SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=40, ignore_eos=True)
              for t, k, s in ((0.3, -1, 1), (0.3, 20, 2), (0.2, -1, 3))]
    ref, _ = run(small_vocab_model, SMALL_PROMPTS, params, None)
    out, stats = run(small_vocab_model, SMALL_PROMPTS, params, spec(small_vocab_model))
    assert tokens(out) == tokens(ref)
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_unseeded_sampling_keeps_the_target_distribution(small_vocab_model: str) -> None:
    """Two-sample chi-square tests per output position 1..5: 300 unseeded completions of one prompt with and without
    a draft model (the target itself: its greedy drafts are accepted where the sample agrees)."""
    params = SamplingParams(temperature=0.5, max_tokens=6, ignore_eos=True, n=300)
    engine = dict(num_kvcache_blocks=300, max_num_seqs=300)
    samples = []
    for s, seed in ((None, 1), (spec(small_vocab_model, num_speculative_tokens=3, disable_by_batch_size=300), 2)):
        out, stats = run(small_vocab_model, SMALL_PROMPTS[:1], params, s, seed=seed, **engine)
        samples.append(np.array([c.token_ids for c in out[0].outputs]))  # [300, 6]
    assert 50 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    for pos in range(1, 6):
        a, b = (np.bincount(x[:, pos], minlength=64) for x in samples)
        assert _two_sample_chi2_p(a, b) > 1e-3 / 5, (pos, a, b)  # Bonferroni over the 5 positions


def test_tp2_over_gloo_gives_tp1_tokens(drafts: dict[str, str]) -> None:
    """The draft runs whole in rank 0's process while the target is split over two ranks (pipelined steps between
    the verify steps)."""
    ref, _ = run(drafts["target"], REPEATS, GREEDY, None)
    out, stats = run(drafts["target"], REPEATS, GREEDY, spec(drafts["same"]), tensor_parallel_size=2,
                     async_scheduling=True)
    assert tokens(out) == tokens(ref) and stats.spec_accepted_tokens == stats.spec_draft_tokens > 0


def test_cache_budget_holds_both_caches(drafts: dict[str, str]) -> None:
    """On the CPU the KV budget covers the target's and the draft's blocks (same count, same block size)."""
    engine = dict(device="cpu", max_model_len=256, cpu_kvcache_space_gib=1 / 1024)
    alone = LLM(drafts["target"], **engine).stats().kv_blocks_total
    both = LLM(drafts["target"], speculative_config=spec(drafts["other"]), **engine).stats().kv_blocks_total
    assert both == alone // 2  # the two tiny models have the same KV bytes per block


def test_draft_model_errors_name_the_flag(drafts: dict[str, str], small_vocab_model: str, tmp_path: Path) -> None:
    from nvcli.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="--speculative-config: draft model .*no-such-dir"):
        LLMEngine(EngineConfig(drafts["target"], device="cpu", speculative_config=spec(str(tmp_path / "no-such-dir"))))
    with pytest.raises(ConfigError, match="--speculative-config: the draft model .* vocabulary of 64 tokens, the "
                                          "target 151936"):
        LLMEngine(EngineConfig(drafts["target"], device="cpu", speculative_config=spec(small_vocab_model)))
    config = EngineConfig(speculative_config=spec("some-dir")).speculative_config
    assert (config.method, config.prompt_lookup_min) == ("draft_model", None) and dataclasses.replace(config) == config
    with pytest.raises(ConfigError, match="--speculative-config: .*method ngram takes no model"):
        EngineConfig(speculative_config={**spec(drafts["other"]), "method": "ngram"})


def test_a_draft_that_never_holds_verifies_a_few_times_and_one_that_holds_never_pauses(drafts: dict[str, str]
                                                                                       ) -> None:
    """Backoff (engine/spec_backoff.py): an unrelated draft model (its drafts rejected) verifies each sequence at tokens 1, 3, 7, 15,
    31 of its 40, not at every step; the target as its own draft (every draft kept) verifies at every step. The
    tokens are plain decoding's either way."""
    ref, _ = run(drafts["target"], PLAIN, GREEDY, None)
    out, stats = run(drafts["target"], PLAIN, GREEDY, spec(drafts["other"]))
    assert tokens(out) == tokens(ref)
    assert stats.spec_accepted_tokens == 0  # the premise: nothing held
    assert len(PLAIN) <= stats.spec_verify_rows <= 6 * len(PLAIN)
    out, stats = run(drafts["target"], PLAIN, GREEDY, spec(drafts["same"]))
    assert tokens(out) == tokens(ref)
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    # one verify per K + 1 tokens after the first, each sequence (drafts stop short of max_tokens at the end)
    assert stats.spec_verify_rows >= len(PLAIN) * (GREEDY.max_tokens - 1) // (K + 1)


def test_the_start_up_warm_up_runs_the_drafts_shapes(drafts: dict[str, str]) -> None:
    """DraftProposer.warm_up (run at start-up on a GPU, to compile the draft's eager variants; here called on the
    CPU) runs every shape it warms through the draft's own attention backend and table width, and a job after it
    is unchanged: the target as its own draft still has every draft accepted."""
    ref, _ = run(drafts["target"], REPEATS, GREEDY, None)
    llm = LLM(drafts["target"], speculative_config=spec(drafts["same"]), **{**ENGINE, "max_num_seqs": 3})
    try:
        proposer = llm.engine.proposer
        assert proposer.max_rows == 3  # the row counts whose final norm it warms
        proposer.warm_up()
        out = llm.generate(REPEATS, GREEDY)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert tokens(out) == tokens(ref)
    assert 0 < stats.spec_accepted_tokens == stats.spec_draft_tokens
