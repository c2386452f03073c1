"""Scheduler: continuous batching, chunked prefill, preemption, limits. No torch, milliseconds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nvcli.engine.block_manager import BlockManager
from nvcli.engine.scheduler import ScheduledBatch, Scheduler, first_extra_rows
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


# -- --scheduling-policy priority ------------------------------------------------------------------
def urgent(n: int, priority: int, first: int = 0, max_tokens: int = 4) -> Sequence:
    s = seq(n, max_tokens=max_tokens, first=first)
    s.priority = priority
    return s


def finish_order(sched: Scheduler) -> list[Sequence]:
    done: list[Sequence] = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.seqs, "no progress: scheduler deadlocked"
        for s, index in sched.postprocess(batch, [7] * len(batch.seqs)):
            sched.check_stop(s, eos_token_ids=set(), index=index)
            if s.is_finished:
                done.append(s)
    return done


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_slot_serves_lines_by_priority_then_arrival(policy: str) -> None:
    """vLLM's priority: lower first, ties by arrival. fcfs ignores it (the engine refuses a priority under fcfs)."""
    sched = Scheduler(BlockManager(64, BS), 1, 64, 64, True, policy)
    seqs = [urgent(5, p, first=10 * i) for i, p in enumerate([3, 1, 2, 1, 0])]
    for s in seqs:
        sched.add(s)
    got = [seqs.index(s) for s in finish_order(sched)]
    assert got == ([4, 1, 3, 2, 0] if policy == "priority" else [0, 1, 2, 3, 4])


def _until_preemption(policy: str, num_blocks: int, waves: list[list[tuple[int, int]]]
                      ) -> tuple[Scheduler, list[Sequence], ScheduledBatch]:
    """Sequences of (prompt length, priority) arriving in waves, a step after each wave, then steps until one
    preempts: the scheduler, the sequences in arrival order and that step's batch."""
    sched = Scheduler(BlockManager(num_blocks, BS), 8, 64, 64, True, policy)
    seqs: list[Sequence] = []
    for k, wave in enumerate(waves):
        for n, priority in wave:
            seqs.append(urgent(n, priority, first=100 * len(seqs), max_tokens=8))
            sched.add(seqs[-1])
        if k < len(waves) - 1:
            sched.postprocess(batch := sched.schedule(), [7] * len(batch.seqs))
    assert not sched.num_preemptions
    for _ in range(64):
        batch = sched.schedule()
        if sched.num_preemptions:
            return sched, seqs, batch
        sched.postprocess(batch, [7] * len(batch.seqs))
    raise AssertionError("no preemption")


def test_a_full_cache_preempts_the_least_urgent_running_sequence_not_the_newest() -> None:
    """a (priority 5) came a step before b (priority 0); b's decode needs a block and none is free. fcfs preempts the
    newest, b; priority preempts a, although the step had scheduled a's decode already: a leaves the step, and one
    of its blocks goes to b."""
    waves = [[(4, 5)], [(3, 0)]]
    sched, (a, b), batch = _until_preemption("fcfs", 3, waves)
    assert batch.seqs == [a] and b.status == SequenceStatus.WAITING and b.num_preemptions == 1

    sched, (a, b), batch = _until_preemption("priority", 3, waves)
    assert batch.seqs == [b] and batch.num_new_tokens == [1]
    assert a.status == SequenceStatus.WAITING and a.num_preemptions == 1 and not a.block_table
    assert list(sched.waiting) == [a] and sched.running == [b]
    assert sched.block_manager.num_free_blocks == 1  # a's two blocks came back, b took one
    sched.postprocess(batch, [7])
    done = finish_order(sched)
    assert done == [b, a] and all(s.num_completion_tokens == 8 for s in (a, b))


def test_a_least_urgent_sequence_preempts_itself_and_the_more_urgent_after_it_still_run() -> None:
    """Running [x (0), v (5), y (0)]: v needs a block, none is free, and v is the least urgent: v goes, and y, which
    decodes inside its block, still runs this step. fcfs preempts the newest, y, and v runs."""
    waves = [[(1, 0), (3, 5)], [(1, 0)]]
    sched, (x, v, y), batch = _until_preemption("priority", 3, waves)
    assert batch.seqs == [x, y] and v.status == SequenceStatus.WAITING and sched.running == [x, y]

    sched, (x, v, y), batch = _until_preemption("fcfs", 3, waves)
    assert batch.seqs == [x, v] and y.status == SequenceStatus.WAITING


def test_a_preempted_sequence_waits_at_its_priority_place() -> None:
    """Preempted, a sequence goes back behind more urgent waiting ones and ahead of less urgent ones (fcfs puts it at
    the front), and an abort takes a waiting sequence out of the middle of the queue."""
    sched, (a, b), batch = _until_preemption("priority", 3, [[(4, 5)], [(3, 0)]])
    sched.postprocess(batch, [7])
    early, late, gone = urgent(4, 1, first=500), urgent(4, 9, first=600), urgent(4, 7, first=700)
    for s in (late, early, gone):
        sched.add(s)
    assert list(sched.waiting) == [early, a, gone, late] and sched.waiting[0] is early
    sched.finish(gone, "abort")
    assert list(sched.waiting) == [early, a, late]
    assert [s for s in finish_order(sched) if s is not b] == [early, a, late]


def test_the_priority_queue_is_a_deque_to_its_callers() -> None:
    """fcfs keeps its deque (nothing new on its per-step path); priority's heap answers the deque members used."""
    from collections import deque

    from nvcli.engine.waiting_queue import PriorityQueue, waiting_queue

    assert type(make()[0].waiting) is deque
    q = PriorityQueue(lambda x: (x[0], x[1]))
    items = [[2, 0], [1, 1], [2, 2], [0, 3], [1, 4]]  # lists: the heap must never compare two items
    for item in items[:4]:
        q.append(item)
    q.appendleft(items[4])  # given back: at its key's place, not at the front
    assert len(q) == 5 and q[0] is items[3]
    q.remove(items[0])
    with pytest.raises(ValueError):
        q.remove([1, 1])  # an equal list, not the one queued
    assert [q.popleft() for _ in range(len(q))] == [[0, 3], [1, 1], [1, 4], [2, 2]]
    with pytest.raises(IndexError):
        q[0]
    with pytest.raises(ValueError, match="scheduling policy"):
        waiting_queue("lifo", lambda s: (0, 0))


def test_first_extra_rows_follow_every_own_row_in_batch_order() -> None:
    assert first_extra_rows(3, [2, 0, 3]) == [3, 5, 5, 8]  # sequence i's extra rows: [i] .. [i + 1] - 1; 8 rows
    assert first_extra_rows(2, []) == first_extra_rows(2, None) == [2, 2, 2]  # no drafts: the own rows only
