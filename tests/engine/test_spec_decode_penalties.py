"""Speculative decoding with penalties and min_tokens (engine/spec_decode.py, engine/penalties.py): a verify row's
extra rows read the sequence's history plus the drafts before them, and ban by their own output position, so the
tokens are those of plain decoding, with n-gram drafts and with a draft model."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from test_draft_model import small_vocab_model  # noqa: F401  (a fixture; tests/engine is on sys.path)
from test_penalties import reference
from test_spec_decode import ENGINE, GREEDY, REPEATS, SMALL_PROMPTS, SPEC, plain_outputs, tokens

from nvcli import LLM, SamplingParams
from nvcli.engine.penalties import PenaltySlots, apply_penalties
from nvcli.engine.sampling_stage import SamplingInputs
from nvcli.engine.scheduler import PENDING, ScheduledBatch
from nvcli.engine.sequence import Sequence
from nvcli.testing.tiny_models import QWEN3_EOS

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------- the pieces
def test_verify_rows_read_the_history_plus_the_drafts_before_them_and_keep_only_accepted_tokens() -> None:
    vocab = 40
    a = Sequence([1, 2, 3], SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
                 block_size=16)
    a.token_ids += [7, 8, PENDING]
    slots = PenaltySlots(CPU)
    slots.record(slots.prepare([a], [5], vocab), torch.tensor([7]))  # a plain step: a's slot holds 7, 8, 7
    a.token_ids[5] = 7
    b = Sequence([4, 5], SamplingParams(), block_size=16)  # verifies, no penalties
    b.token_ids += [6, 1, 2, PENDING]
    c = Sequence([6], SamplingParams(frequency_penalty=1.0), block_size=16)  # penalized, no drafts
    c.token_ids += [9, PENDING]
    d = Sequence([10, 11], SamplingParams(presence_penalty=1.0), block_size=16)  # new to the pool in a verify step
    d.token_ids += [12, 13, 14, 15, PENDING]  # output 12, 13; drafts 14, 15
    a.token_ids += [9, 7, 9, PENDING]  # drafts 9, 7, 9
    seqs, index, k = [a, b, c, d], [9, 5, 2, 6], [3, 2, 0, 2]
    # rows: own 0..3, then extras: a 4, 5, 6; b 7, 8; d 9, 10
    pb = slots.prepare(seqs, index, vocab, k)
    assert pb is not None and pb.verify is not None and pb.rows.tolist() == [0, 2, 3, 4, 5, 6, 9, 10]
    history = {0: (a, [7, 8, 7, 9, 7, 9]), 4: (a, [7, 8, 7]), 5: (a, [7, 8, 7, 9]), 6: (a, [7, 8, 7, 9, 7]),
               2: (c, [9]), 3: (d, [12, 13, 14, 15]), 9: (d, [12, 13]), 10: (d, [12, 13, 14])}
    logits = torch.randn(11, vocab, generator=torch.Generator().manual_seed(0)) * 3
    out = apply_penalties(logits, pb)
    for row in range(11):
        if row in history:
            seq, output = history[row]
            sp = seq.sampling_params
            want = reference(logits[row], seq.token_ids[: seq.num_prompt_tokens], output, sp.presence_penalty,
                             sp.frequency_penalty, sp.repetition_penalty)
            torch.testing.assert_close(out[row].double(), want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out[row], logits[row])  # b's rows
    assert slots.counts is not None and slots.seen is not None
    assert slots.counts[slots.slot_of(a)].sum().item() == 3  # the pool is untouched until record
    # a samples 9, 7 (= its drafts), then 20: keeps 9, 7, 20. d samples 30 (not its draft 14): keeps 30.
    sampled = torch.tensor([21, 0, 33, 32, 9, 7, 20, 0, 0, 30, 31])
    slots.record(pb, sampled)
    counts = slots.counts
    assert {t: counts[slots.slot_of(a), t].item() for t in counts[slots.slot_of(a)].nonzero().flatten().tolist()} \
        == {7: 3, 8: 1, 9: 1, 20: 1}
    assert slots.seen[slots.slot_of(a)].nonzero().flatten().tolist() == [1, 2, 3, 7, 8, 9, 20]
    assert counts[slots.slot_of(c)].nonzero().flatten().tolist() == [9, 33]
    assert counts[slots.slot_of(d)].nonzero().flatten().tolist() == [12, 13, 30]
    assert slots.slot_of(b) is None


def test_min_tokens_bans_each_verify_row_by_its_own_position() -> None:
    seq = Sequence([1, 2, 3], SamplingParams(min_tokens=4), block_size=16)
    seq.min_tokens_banned = (0, 5)
    seq.token_ids += [5, 6, 7, 8, 9, PENDING]  # output positions 0, 1; drafts at 2, 3, 4; own row samples 5
    batch = ScheduledBatch([seq], [4], [4], [8], num_drafts=[3])
    inputs = SamplingInputs.of(batch)
    assert inputs.positions == [5, 2, 3, 4]
    assert inputs.banned == [(1, (0, 5)), (2, (0, 5))]  # the rows sampling positions 2 and 3 (< min_tokens)


# ---------------------------------------------------------------------------------------------- end to end
def run(model: str, prompts, params, spec: dict | None, **engine):
    """Outputs, stats, and per request the drafts verified and accepted (Scheduler._accept)."""
    llm = LLM(model, speculative_config=spec, **{**ENGINE, **engine})
    drafted: Counter[str] = Counter()
    accepted: Counter[str] = Counter()
    accept = llm.engine.scheduler._accept

    def recording_accept(seq: Sequence, index: int, samples: list[int]) -> int:
        n = accept(seq, index, samples)
        drafted[seq.request_id] += len(samples) - 1
        accepted[seq.request_id] += n
        return n

    llm.engine.scheduler._accept = recording_accept  # type: ignore[method-assign]
    try:
        outs = llm.generate(prompts, params)
        return outs, llm.stats(), [(drafted[o.request_id], accepted[o.request_id]) for o in outs]
    finally:
        llm.shutdown()


# Greedy rows with penalties mild enough that the tiny model still loops (so drafts get accepted); min_tokens against
# a stop id that logit_bias makes every position's favourite (plain decoding bans it for 12 tokens, then ends on it);
# seeded sampled rows with penalties. The first prompt comes twice (its blocks then come from the prefix cache), and
# 14 blocks of 16 tokens for 6 sequences of up to 97 make the scheduler preempt.
PARAMS = [dataclasses.replace(GREEDY, max_tokens=32, repetition_penalty=1.05),
          dataclasses.replace(GREEDY, max_tokens=32, presence_penalty=0.5),
          dataclasses.replace(GREEDY, max_tokens=32, frequency_penalty=0.05, presence_penalty=0.1),
          dataclasses.replace(GREEDY, max_tokens=32, min_tokens=12, stop_token_ids=[50], logit_bias={50: 30.0}),
          SamplingParams(temperature=0.3, seed=1, max_tokens=32, ignore_eos=True, repetition_penalty=1.1),
          SamplingParams(temperature=0.2, top_k=20, seed=3, max_tokens=32, ignore_eos=True, presence_penalty=0.3,
                         frequency_penalty=0.1, repetition_penalty=1.05)]
PROMPTS = SMALL_PROMPTS + SMALL_PROMPTS[:1] + SMALL_PROMPTS[1:3]
TIGHT = dict(num_kvcache_blocks=14, max_model_len=192)
@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_penalties_and_min_tokens_give_plain_decodings_tokens(small_vocab_model: str, proposer: str) -> None:  # noqa: F811
    """Every request speculates (drafts verified, some accepted) and gets plain decoding's tokens and finish
    reasons: greedy rows the same tokens, seeded rows the same draws (a draw depends on the seed, the position and
    the history before it, which counts the drafts before its row). The draft model is the target without the
    penalties and the bias: some drafts are rejected."""
    ref = plain_outputs(run, small_vocab_model, PROMPTS, PARAMS, **TIGHT)
    spec = ({**SPEC, "disable_by_batch_size": 16} if proposer == "ngram"
            else {"model": small_vocab_model, "num_speculative_tokens": 4, "disable_by_batch_size": 16})
    out, stats, per_request = run(small_vocab_model, PROMPTS, PARAMS, spec, **TIGHT)
    assert tokens(out) == tokens(ref)
    reasons = [o.outputs[0].finish_reason for o in out]
    assert reasons == [o.outputs[0].finish_reason for o in ref] == ["length"] * 3 + ["stop"] + ["length"] * 2
    assert len(out[3].outputs[0].token_ids) == 13  # 12 banned positions, then the stop id
    assert all(a > 0 for _, a in per_request), per_request  # every request verified drafts and accepted some
    assert sum(a for _, a in per_request) == stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_min_tokens_holds_the_eos_back_in_verify_rows(tiny_model_dir, proposer: str) -> None:
    """The model's EOS, made every position's favourite by logit_bias, is banned at each verify row whose own output
    position is below min_tokens: the request ends on it at position 12, as in plain decoding."""
    model = str(tiny_model_dir("qwen3"))
    params = dataclasses.replace(GREEDY, max_tokens=24, min_tokens=12, ignore_eos=False, logit_bias={QWEN3_EOS: 30.0})
    ref = plain_outputs(run, model, REPEATS[1:2], params)
    spec = SPEC if proposer == "ngram" else {"model": model, "num_speculative_tokens": 4}
    out, _, per_request = run(model, REPEATS[1:2], params, spec)
    assert tokens(out) == tokens(ref)
    assert out[0].outputs[0].token_ids[12:] == [QWEN3_EOS] and out[0].outputs[0].finish_reason == "stop"
    assert per_request[0][1] > 0


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_verify_step_with_penalties_never_makes_the_host_wait() -> None:
    """The step-local history rows and the record of the kept tokens are enqueued without a host sync."""
    cuda = torch.device("cuda")
    vocab = 1000
    slots = PenaltySlots(cuda)
    seqs = [Sequence([1, 2, 3], SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5), block_size=16)
            for _ in range(2)]
    for seq in seqs:
        seq.token_ids += [7, 8, 9, PENDING]  # output 7; drafts 8, 9
    logits = torch.randn(6, vocab, device=cuda)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pb = slots.prepare(seqs, [6, 6], vocab, [2, 2])
        slots.record(pb, apply_penalties(logits, pb).argmax(dim=-1))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert pb.verify is not None and slots.counts[slots.slot_of(seqs[0]), 7].item() == 1
