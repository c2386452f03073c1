"""Scheduler: continuous batching, chunked prefill, preemption, limits. No torch, milliseconds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nvcli.engine.block_manager import BlockManager
from nvcli.engine.scheduler import Scheduler
from nvcli.engine.sequence import Sequence, SequenceStatus
from nvcli.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int = 64, max_seqs: int = 8, budget: int = 64, max_len: int = 64, chunked: bool = True):
    bm = BlockManager(num_blocks, BS)
    return Scheduler(bm, max_seqs, budget, max_len, chunked), bm


def seq(n: int, max_tokens: int = 4, first: int = 0) -> Sequence:
    return Sequence(list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), BS)


def run_to_end(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.seqs, "no progress: scheduler deadlocked"
        produced = sched.postprocess(batch, [7] * len(batch.seqs))
        for s, index in produced:
            sched.check_stop(s, eos_token_ids=set(), index=index)
        steps += 1
        assert steps < max_steps
    return steps


def test_scheduler_imports_no_torch() -> None:
    code = "import sys, nvcli.engine.scheduler, nvcli.engine.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefill_then_decode_in_one_batch() -> None:
    sched, _ = make()
    a, b = seq(10), seq(6, first=100)
    sched.add(a)
    batch = sched.schedule()
    assert batch.num_new_tokens == [10]
    sched.postprocess(batch, [1])
    sched.add(b)
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == [a.seq_id, b.seq_id]
    assert batch.num_new_tokens == [1, 6]  # a decode and a prefill share the step
    assert not batch.is_decode_only


def test_one_token_rows_lead_a_step_with_prompt_chunks() -> None:
    """A step that carries prompt chunks lists its one-token rows first (the GPU runs them through the decode
    kernel, the rest through the prefill kernel), and each sampled token still reaches its own sequence."""
    sched, _ = make(budget=40)
    a, b = seq(12, max_tokens=8), seq(30, max_tokens=8, first=100)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # a's prompt and the first 28 tokens of b's
    assert batch.num_new_tokens == [12, 28]
    sched.postprocess(batch, [5, 0])
    c = seq(6, max_tokens=8, first=200)
    sched.add(c)
    batch = sched.schedule()  # a decodes, b's prompt ends (2 tokens), c's prompt (6)
    assert [s.seq_id for s in batch.seqs] == [a.seq_id, b.seq_id, c.seq_id]
    assert batch.num_new_tokens == [1, 2, 6] and batch.num_single_token_rows == 1
    sched.postprocess(batch, [11, 12, 13])
    batch = sched.schedule()  # all three decode
    assert batch.is_decode_only
    sched.postprocess(batch, [21, 22, 23])
    d = seq(9, max_tokens=8, first=300)
    sched.add(d)
    e = seq(1, max_tokens=8, first=400)
    sched.add(e)
    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1, 1, 1, 9] and batch.num_single_token_rows == 4
    assert [s.seq_id for s in batch.seqs] == [a.seq_id, b.seq_id, c.seq_id, e.seq_id, d.seq_id]
    sched.postprocess(batch, [31, 32, 33, 34, 35])
    assert a.token_ids[-3:] == [11, 21, 31] and c.token_ids[-3:] == [13, 23, 33]
    assert e.token_ids == [400, 34] and d.token_ids[-1] == 35


def test_chunked_prefill_respects_budget_and_lets_decodes_run() -> None:
    sched, _ = make(budget=8)
    a = seq(3)
    sched.add(a)
    sched.postprocess(sched.schedule(), [1])
    long = seq(20, first=50)
    sched.add(long)
    seen = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = sched.schedule()
        assert batch.num_tokens <= 8
        assert a in batch.seqs or a.is_finished
        seen.append(dict(zip([s.seq_id for s in batch.seqs], batch.num_new_tokens)).get(long.seq_id))
        for s, index in sched.postprocess(batch, [1] * len(batch.seqs)):
            sched.check_stop(s, set(), index)
    assert sched.num_chunked_prefills >= 2
    assert long.num_completion_tokens == 1  # only the final chunk produced a token
    run_to_end(sched)


def test_preemption_frees_blocks_and_everything_finishes() -> None:
    sched, bm = make(num_blocks=6, max_len=24)  # 24 tokens of KV; 3 requests need 3x(8+8)
    seqs = [seq(8, max_tokens=8, first=i * 100) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert sched.num_preemptions > 0
    assert all(s.status == SequenceStatus.FINISHED and s.num_completion_tokens == 8 for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks


def test_max_num_seqs_limits_running() -> None:
    sched, _ = make(max_seqs=2)
    for i in range(5):
        sched.add(seq(4, first=i * 10))
    batch = sched.schedule()
    assert len(batch.seqs) == 2 and len(sched.waiting) == 3
    run_to_end(sched)


def test_prompt_longer_than_max_model_len_is_rejected() -> None:
    sched, _ = make(max_len=16)
    with pytest.raises(ValueError, match="max-model-len"):
        sched.add(seq(17))


def test_finish_by_max_tokens_and_model_len() -> None:
    sched, _ = make(max_len=12)
    a = seq(4, max_tokens=100)
    b = seq(4, max_tokens=3, first=50)
    sched.add(a)
    sched.add(b)
    run_to_end(sched)
    assert a.finish_reason == "length" and a.num_tokens == 12
    assert b.finish_reason == "length" and b.num_completion_tokens == 3


def test_eos_and_stop_ids_respect_min_tokens() -> None:
    sched, _ = make()
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9]), BS)
    sched.add(s)
    for token in (9, 5, 9):
        produced = sched.postprocess(sched.schedule(), [token])
        for p, index in produced:
            sched.check_stop(p, eos_token_ids={42}, index=index)
    assert s.finish_reason == "stop" and s.stop_reason == 9 and s.completion_token_ids == [9, 5, 9]
    assert s.stop_token_ended


def test_eos_ends_with_stop_reason_none_as_in_vllm() -> None:
    """vLLM's stop_reason: the stop token id or string, None when EOS ended the request."""
    sched, _ = make()
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=10), BS)
    sched.add(s)
    for token in (5, 42):
        for p, index in sched.postprocess(sched.schedule(), [token]):
            sched.check_stop(p, eos_token_ids={42}, index=index)
    assert (s.finish_reason, s.stop_reason, s.completion_token_ids, s.stop_token_ended) == ("stop", None, [5, 42], True)


def test_abort_waiting_and_running() -> None:
    sched, bm = make(max_seqs=1)
    a, b = seq(4), seq(4, first=10)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_hit_through_scheduler() -> None:
    sched, bm = make()
    a = seq(13)
    sched.add(a)
    run_to_end(sched)
    b = seq(13)
    sched.add(b)
    batch = sched.schedule()
    assert b.num_cached_tokens == 12 and batch.num_new_tokens == [1]
    run_to_end(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_prompt_waits_for_the_prefix_another_prompt_is_computing() -> None:
    """Lines behind one instruction: the first computes it, the next is admitted a step later and reads it from the
    prefix cache, so both block tables start with the same pages (what shared-prefix decode needs)."""
    sched, bm = make()
    instruction = list(range(500, 512))  # three full blocks
    a = Sequence(instruction + [1, 2], SamplingParams(max_tokens=4, ignore_eos=True), BS)
    b = Sequence(instruction + [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True), BS)
    other = seq(6, first=900)
    for s in (a, b, other):
        sched.add(s)
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == [a.seq_id]  # b waits, and FIFO keeps `other` behind it
    sched.postprocess(batch, [7])
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == [a.seq_id, b.seq_id, other.seq_id]
    assert b.num_cached_tokens == 3 * BS and b.block_table[:3] == a.block_table[:3]
    assert batch.num_new_tokens == [1, 3, 6]


def test_prompts_with_their_own_first_block_are_admitted_together() -> None:
    sched, _ = make()
    seqs = [seq(9, first=100 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    assert len(sched.schedule().seqs) == 4


def test_the_prefix_wait_forgets_registered_prompts() -> None:
    """A million-line job admits a prompt per line: the record of prompts in computation stays bounded."""
    sched, _ = make(num_blocks=256, max_seqs=4, budget=256, max_len=64)
    for i in range(200):
        sched.add(seq(9, max_tokens=1, first=1000 + 100 * i))
    run_to_end(sched)
    assert len(sched._computing) <= 2 * sched.max_num_seqs + 4
