"""engine/penalties.py: vLLM's presence / frequency / repetition penalties, against a direct formula, HF
transformers' logits processors and HF greedy generation, with the per-sequence token history kept on the device."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from nvcli import LLM, SamplingParams
from nvcli.engine.penalties import PenaltyBatch, PenaltySlots, apply_penalties
from nvcli.engine.sampler import SamplingBatch, sample
from nvcli.engine.scheduler import PENDING
from nvcli.engine.sequence import Sequence, SequenceStatus

CPU = torch.device("cpu")
MAX_TOKENS = 24
PROMPTS = [list(range(1000, 1005)), list(range(2000, 2040)), list(range(3000, 3023)), list(range(4000, 4070))]


def greedy(**penalties: float) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **penalties)


# ---------------------------------------------------------------------------- the formula


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float,
              repetition: float) -> torch.Tensor:
    """vLLM's apply_penalties for one row, element by element in float64."""
    out = logits.double().clone()
    for tok in range(out.numel()):
        n = output.count(tok)
        x = out[tok].item()
        if tok in prompt or n:
            x = x / repetition if x > 0 else x * repetition
        x -= frequency * n
        x -= presence * (n > 0)
        out[tok] = x
    return out


def test_apply_penalties_matches_the_formula_and_leaves_other_rows_bit_for_bit() -> None:
    vocab = 40
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen) * 3  # negative and positive logits
    logits[1, 5] = 0.0
    logits[3, 7] = float("-inf")
    rows = [0, 1, 3, 5]
    settings = [(0.5, 0.0, 1.0), (0.0, 1.5, 1.3), (-0.7, 0.3, 0.8), (0.0, 0.0, 2.0)]  # presence, frequency, repetition
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(6)] for _ in rows]
    outputs = [[rng.choice([2, 2, 2, 5, 7, 9, rng.randrange(vocab)]) for _ in range(12)] for _ in rows]  # repeats
    slots = [3, 0, 2, 1]
    counts = torch.zeros(4, vocab, dtype=torch.int32)
    seen = torch.zeros(4, vocab, dtype=torch.bool)  # prompt_mask | output_mask
    for slot, prompt, output in zip(slots, prompts, outputs):
        for tok in output:
            counts[slot, tok] += 1
        seen[slot, prompt + output] = True
    pb = PenaltyBatch(
        rows=torch.tensor(rows), slots=torch.tensor(slots),
        presence=torch.tensor([s[0] for s in settings]), frequency=torch.tensor([s[1] for s in settings]),
        repetition=torch.tensor([s[2] for s in settings]), counts=counts, seen=seen)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        before = x.clone()
        out = apply_penalties(x, pb)
        assert out.dtype == torch.float32
        assert torch.equal(x, before)  # the caller's logits give the logprobs
        for row in range(6):
            if row in rows:
                i = rows.index(row)
                ref = reference(x[row].float(), prompts[i], outputs[i], *settings[i])
                torch.testing.assert_close(out[row].double(), ref, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(out[row], x[row].float())  # untouched, bit for bit
    assert not torch.equal(out[rows], logits.bfloat16().float()[rows])

    # every row penalized (a model whose generation_config sets repetition_penalty): no gather / scatter of rows,
    # the same numbers, and the caller's float32 logits still untouched
    every = PenaltyBatch(rows=torch.arange(4), slots=torch.tensor(slots), presence=pb.presence,
                         frequency=pb.frequency, repetition=pb.repetition, counts=counts, seen=seen)
    before = logits.clone()
    fast = apply_penalties(logits[:4], dataclasses.replace(every, all_rows=True))
    assert torch.equal(logits, before)
    assert torch.equal(fast, apply_penalties(logits[:4], every))
    only_rep = dataclasses.replace(every, presence=None, frequency=None, all_rows=True)
    assert torch.equal(apply_penalties(logits[:4], only_rep), apply_penalties(logits[:4], dataclasses.replace(
        only_rep, all_rows=False))) and torch.equal(logits, before)

    # fields left out where every row has the neutral value: the same result
    only_freq = PenaltyBatch(rows=torch.tensor([1]), slots=torch.tensor([0]), presence=None,
                             frequency=torch.tensor([1.5]), repetition=None, counts=counts, seen=None)
    ref = reference(logits[1], [], outputs[1], 0.0, 1.5, 1.0)
    torch.testing.assert_close(apply_penalties(logits, only_freq)[1].double(), ref, rtol=1e-6, atol=1e-6)


def test_repetition_penalty_equals_hf_logits_processor() -> None:
    """Slot state built from a sequence's prompt and its completion tokens, read back by the host (which a slot
    assigned late adds), gives HF's RepetitionPenaltyLogitsProcessor over prompt + output ids."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    vocab = 300
    gen = torch.Generator().manual_seed(1)
    prompt = [5, 9, 9, 100, 250, 7]
    output = [9, 42, 42, 42, 299, 0]
    for penalty in (1.3, 0.7):
        seq = Sequence(prompt, SamplingParams(repetition_penalty=penalty), block_size=16)
        for tok in output:
            seq.append_token(tok)
        seq.append_token(PENDING)  # the token this step samples
        slots = PenaltySlots(CPU)
        pb = slots.prepare([seq], [seq.num_tokens - 1], vocab)
        assert pb is not None and pb.repetition is not None and pb.presence is None and pb.frequency is None
        scores = torch.randn(1, vocab, generator=gen) * 4
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), scores.clone())
        assert torch.equal(apply_penalties(scores, pb), expected)


def test_sampler_rows_without_penalties_draw_what_they_draw_alone() -> None:
    """sample(): penalized neighbours switch the batch to a float32 copy; a greedy and a seeded row beside them draw
    the token they draw alone, and a penalized greedy row takes the argmax of its penalized logits."""
    vocab = 64
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, vocab, generator=gen) * 2).bfloat16()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, frequency_penalty=2.0),
              SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8, presence_penalty=1.0)]
    slots = PenaltySlots(CPU)
    seqs = [Sequence([1, 2, 3], p, block_size=16) for p in params]
    top = logits[1].float().argmax().item()
    for _ in range(3):
        seqs[1].append_token(top)  # the row's favourite, generated 3 times: -6 makes it lose
    pb = slots.prepare(seqs, [3, 6, 3, 3], vocab)
    assert pb is not None and pb.rows.tolist() == [1, 3]

    def draw(rows: list[int], penalties: PenaltyBatch | None) -> list[int]:
        sb = SamplingBatch.build([params[r] for r in rows], [0] * len(rows), vocab, CPU, penalties=penalties)
        return sample(logits[rows], sb, torch.Generator().manual_seed(0)).tolist()

    together = draw([0, 1, 2, 3], pb)
    assert together[0] == draw([0], None)[0] == logits[0].float().argmax().item()
    assert together[2] == draw([2], None)[0]
    assert together[1] == apply_penalties(logits, pb)[1].argmax().item() != top
    assert draw([0, 1, 2, 3], None)[1] == top  # the penalty is what changed it


# ---------------------------------------------------------------------------- the slot pool


def seq_with(sp: SamplingParams, prompt: list[int] | None = None) -> Sequence:
    seq = Sequence(prompt or [1, 2, 3], sp, block_size=16)
    seq.append_token(PENDING)
    return seq


def test_no_state_without_penalized_sampling_rows() -> None:
    slots = PenaltySlots(CPU)
    plain = seq_with(SamplingParams())
    chunk = Sequence([4, 5, 6, 7], SamplingParams(frequency_penalty=1.0), block_size=16)  # a non-final prompt chunk
    assert slots.prepare([plain, chunk], [3, -1], 50) is None
    assert slots.counts is None and slots.seen is None and slots.num_slots == 0 and slots.slot_of(chunk) is None


def test_sampled_tokens_are_counted_on_the_device_for_penalized_sampling_rows_only() -> None:
    vocab = 50
    slots = PenaltySlots(CPU)
    a = seq_with(SamplingParams(frequency_penalty=0.5))
    chunk = Sequence([4, 5, 6, 7], SamplingParams(frequency_penalty=1.0), block_size=16)
    plain = seq_with(SamplingParams())
    for step, sampled in enumerate([[11, 12, 13], [11, 40, 41], [30, 31, 32]]):
        index = [3 + step, -1 if step < 2 else 4, 3 + step]
        pb = slots.prepare([a, chunk, plain], index, vocab)
        assert pb is not None and not pb.all_rows
        slots.record(pb, torch.tensor(sampled))
    assert slots.seen is None  # no row with repetition_penalty: no seen mask
    counts = slots.counts
    assert counts is not None and counts.dtype == torch.int32
    sa, sc = slots.slot_of(a), slots.slot_of(chunk)
    assert counts[sa, 11].item() == 2 and counts[sa, 30].item() == 1 and counts[sa].sum().item() == 3
    assert counts[sc].sum().item() == 1 and counts[sc, 31].item() == 1  # the chunks that sampled nothing: not counted
    assert slots.slot_of(plain) is None and slots.num_held == 2


def test_a_step_like_the_last_reuses_its_tensors_and_a_reused_slot_starts_clean() -> None:
    vocab = 30
    slots = PenaltySlots(CPU, initial_slots=2)
    a, b = seq_with(SamplingParams(frequency_penalty=1.0)), seq_with(SamplingParams(frequency_penalty=1.0))
    first = slots.prepare([a, b], [3, 3], vocab)
    slots.record(first, torch.tensor([4, 5]))
    again = slots.prepare([a, b], [3, 3], vocab)
    assert again is first  # nothing uploaded
    slots.record(again, torch.tensor([4, 6]))
    assert slots.counts[slots.slot_of(a), 4].item() == 2
    # a finishes; c, with the same settings, takes its row and its slot: the same tensors serve, c's counts are new
    a.status = SequenceStatus.FINISHED
    c = seq_with(SamplingParams(frequency_penalty=1.0))
    assert slots.prepare([c, b], [3, 3], vocab) is first and slots.slot_of(c) == 0
    assert slots.counts[0].sum().item() == 0 and slots.counts[slots.slot_of(b)].sum().item() == 2
    other = slots.prepare([b, c], [3, 3], vocab)
    assert other is not first and other.rows.tolist() == [0, 1] and other.slots.tolist() == [1, 0]


def test_the_pool_grows_past_its_capacity_keeping_every_history() -> None:
    vocab = 20
    slots = PenaltySlots(CPU, initial_slots=2)
    seqs = [seq_with(SamplingParams(presence_penalty=0.5)) for _ in range(5)]
    for i in range(len(seqs)):
        pb = slots.prepare(seqs[: i + 1], [3] * (i + 1), vocab)
        assert pb.all_rows
        slots.record(pb, torch.arange(i + 1) + 10 * (i % 2))
    assert slots.num_slots == 8 and slots.num_held == 5  # 2 -> 4 -> 8
    assert slots.slots_for(5) == 8  # what KV sizing reserves for 5 sequences (kv_sizing.largest_penalty_pool)
    assert slots.seen is None
    counts = slots.counts
    for row, seq in enumerate(seqs):
        expected = torch.zeros(vocab, dtype=torch.int32)
        for i in range(row, 5):
            expected[row + 10 * (i % 2)] += 1
        assert torch.equal(counts[slots.slot_of(seq)], expected), row
    # a repetition row arriving late allocates the seen mask, grown along with the counts from then on
    rep = seq_with(SamplingParams(repetition_penalty=1.2), prompt=[7, 8, 7])
    pb = slots.prepare([rep], [3], vocab)
    assert pb.seen is not None and pb.seen.shape == (8, vocab)
    assert pb.seen[slots.slot_of(rep)].nonzero().flatten().tolist() == [7, 8]
    slots.record(pb, torch.tensor([19]))
    assert pb.seen[slots.slot_of(rep)].nonzero().flatten().tolist() == [7, 8, 19]


def test_finished_sequences_give_their_slots_back_before_the_pool_grows() -> None:
    vocab = 20
    slots = PenaltySlots(CPU, initial_slots=2)
    a, b = seq_with(SamplingParams(repetition_penalty=1.5), [3, 4]), seq_with(SamplingParams(frequency_penalty=1.0))
    slots.record(slots.prepare([a, b], [2, 3], vocab), torch.tensor([5, 6]))
    assert slots.seen[slots.slot_of(a)].nonzero().flatten().tolist() == [3, 4, 5]  # prompt, then what it sampled
    preempted = b
    preempted.status = SequenceStatus.WAITING  # keeps its slot and its counts
    a.status = SequenceStatus.FINISHED
    c = seq_with(SamplingParams(repetition_penalty=2.0), prompt=[9])
    slots.prepare([c], [2], vocab)
    assert slots.num_slots == 2 and slots.slot_of(c) == 0 and slots.slot_of(a) is None  # a's slot, reused
    assert slots.counts[0].sum().item() == 0  # zeroed for its new holder
    assert slots.seen[0].nonzero().flatten().tolist() == [9]
    assert slots.counts[slots.slot_of(b), 6].item() == 1
    d = seq_with(SamplingParams(presence_penalty=1.0))
    slots.prepare([d], [3], vocab)  # nothing finished: grows
    assert slots.num_slots == 4 and slots.slot_of(d) == 2


# ---------------------------------------------------------------------------- end to end, against HF

_hf: dict[tuple, list[int]] = {}


class ReferencePenalties:
    """vLLM's penalties as an HF logits processor: counts of the tokens generated after the prompt, from input_ids."""

    def __init__(self, prompt_len: int, presence: float, frequency: float, repetition: float) -> None:
        self.prompt_len, self.presence, self.frequency, self.repetition = prompt_len, presence, frequency, repetition

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0].tolist()
        prompt, output = ids[: self.prompt_len], ids[self.prompt_len :]
        x = scores[0].clone()
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[prompt + output] = True
        counts = torch.zeros_like(x)
        for tok in output:
            counts[tok] += 1
        x = torch.where(seen, torch.where(x > 0, x / self.repetition, x * self.repetition), x)
        x = x - self.frequency * counts - self.presence * (counts > 0).float()
        return x.unsqueeze(0)


def hf_greedy(model_dir, prompt: list[int], presence: float = 0.0, frequency: float = 0.0,
              repetition: float = 1.0, own_processor: bool = False) -> list[int]:
    """HF greedy tokens; repetition alone through HF's own processor, otherwise through ReferencePenalties."""
    key = (str(model_dir), tuple(prompt), presence, frequency, repetition, own_processor)
    if key not in _hf:
        from transformers import AutoModelForCausalLM, LogitsProcessorList

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        kwargs: dict = {}
        if own_processor:
            kwargs["repetition_penalty"] = repetition
        elif (presence, frequency, repetition) != (0.0, 0.0, 1.0):
            kwargs["logits_processor"] = LogitsProcessorList(
                [ReferencePenalties(len(prompt), presence, frequency, repetition)])
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0, **kwargs)
        _hf[key] = out[0, len(prompt):].tolist()
    return _hf[key]


REGIMES = {
    "plain": dict(num_kvcache_blocks=128),
    "preemption": dict(num_kvcache_blocks=8, max_model_len=128),
    "chunked_prefill": dict(num_kvcache_blocks=128, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("regime, async_scheduling", [("plain", False), ("preemption", False), ("preemption", True),
                                                      ("chunked_prefill", True)])
def test_repetition_penalty_greedy_matches_hf_generate(tiny_model_dir, regime: str, async_scheduling: bool) -> None:
    """HF generate(repetition_penalty=1.3), token for token, for penalized prompts batched with unpenalized ones;
    through preemption (recompute keeps the counts) and with async scheduling (counts updated on the device)."""
    model_dir = tiny_model_dir("qwen3")
    kwargs = dict(device="cpu", max_model_len=256, async_scheduling=async_scheduling)
    kwargs.update(REGIMES[regime])
    llm = LLM(str(model_dir), **kwargs)
    assert llm.engine.async_scheduling == async_scheduling
    penalized = [True, False, True, True]
    outs = llm.generate(PROMPTS, [greedy(repetition_penalty=1.3) if p else greedy() for p in penalized])
    for prompt, out, p in zip(PROMPTS, outs, penalized):
        expected = hf_greedy(model_dir, prompt, repetition=1.3, own_processor=True) if p else hf_greedy(model_dir, prompt)
        assert out.outputs[0].token_ids == expected, (prompt[0], p)
    assert hf_greedy(model_dir, PROMPTS[0], repetition=1.3, own_processor=True) != hf_greedy(model_dir, PROMPTS[0])
    stats = llm.stats()
    assert stats.num_preemptions > 0 if regime == "preemption" else True
    assert stats.num_chunked_prefills > 0 if regime == "chunked_prefill" else True
    assert stats.kv_blocks_used == 0


def test_frequency_and_presence_penalties_match_a_python_reference(tiny_model_dir) -> None:
    """Greedy with frequency / presence penalties (and all three) equals HF generate with the formula as a python
    logits processor; logprobs stay those of the model's raw logits."""
    model_dir = tiny_model_dir("qwen3")
    llm = LLM(str(model_dir), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    runner = llm.engine.executor.runner
    llm.generate(PROMPTS[:1], greedy())
    assert runner.sampling.penalty_slots.counts is None  # a job without penalties allocates nothing
    cases = [dict(frequency=2.0), dict(presence=1.5, frequency=0.5), dict(presence=-0.5, frequency=1.0, repetition=1.2)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1,
                             **{f"{k}_penalty": v for k, v in case.items()}) for case in cases]
    outs = llm.generate(prompts, params)
    for prompt, out, case in zip(prompts, outs, cases):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, **case), case
    ids = outs[0].outputs[0].token_ids
    assert ids != hf_greedy(model_dir, PROMPTS[0])  # the penalty did change the output

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([PROMPTS[0] + ids])).logits[0, len(PROMPTS[0]) - 1 : -1], -1)
    ranks = []
    for i, (tok, entry) in enumerate(zip(ids, outs[0].outputs[0].logprobs)):
        assert entry[tok].logprob == pytest.approx(raw[i, tok].item(), abs=1e-4)
        ranks.append(entry[tok].rank)
    assert max(ranks) > 1  # some chosen tokens are not the raw argmax: the logprobs are not the penalized ones


def beside_penalized_neighbours(targets: list[tuple[list[int], SamplingParams]],
                                penalized: bool = True) -> list[tuple[list[int], SamplingParams]]:
    """Three (prompt, params) with penalized requests before and between them (`penalized` False: the same requests
    without their penalties, so every step has the same rows)."""
    first = {"frequency_penalty": 2.0} if penalized else {}
    second = {"presence_penalty": 2.0, "repetition_penalty": 1.5} if penalized else {}
    neighbours = [(list(range(700, 740)), greedy(**first)),
                  (list(range(800, 805)), SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, **second))]
    return [neighbours[0], targets[0], targets[1], neighbours[1], targets[2]]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_without_penalties_are_unchanged_by_penalized_neighbours(tiny_model_dir, async_scheduling: bool) -> None:
    """Greedy and seeded rows give alone exactly what they give beside penalized rows; a seeded penalized row too."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128,
              async_scheduling=async_scheduling)
    plain_greedy = greedy()
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    seeded_penalized = SamplingParams(temperature=0.9, seed=77, max_tokens=20, ignore_eos=True, frequency_penalty=1.0,
                                      repetition_penalty=1.1)
    targets = [(PROMPTS[0], plain_greedy), (PROMPTS[2], seeded), (PROMPTS[1], seeded_penalized)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in targets]
    batch = beside_penalized_neighbours(targets)
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch])
    assert [outs[i].outputs[0].token_ids for i in (1, 2, 4)] == alone
    assert llm.engine.executor.runner.sampling.penalty_slots.num_held > 0


def test_tensor_parallel_async_with_penalties_matches_one_rank(tiny_model_dir) -> None:
    """Only rank 0 samples, so only it keeps penalty state; TP=2 with async scheduling, preemption and prompt
    chunks gives TP=1's tokens."""
    model = str(tiny_model_dir("qwen3"))
    tight = dict(device="cpu", num_kvcache_blocks=8, max_model_len=128, max_num_batched_tokens=16)
    params = [greedy(repetition_penalty=1.3), greedy(), greedy(frequency_penalty=1.0, presence_penalty=0.5),
              greedy(repetition_penalty=0.9)]
    ref = LLM(model, **tight).generate(PROMPTS, params)
    llm = LLM(model, tensor_parallel_size=2, async_scheduling=True, **tight)
    try:
        out = llm.generate(PROMPTS, params)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0


# ---------------------------------------------------------------------------- GPU

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
def test_penalty_state_never_makes_the_host_wait() -> None:
    """Async scheduling launches step N+1 while step N runs: assigning slots (first use, growth, reclaim), applying
    the penalties and counting the sampled tokens must not synchronize with the device."""
    cuda = torch.device("cuda")
    vocab = 1000
    slots = PenaltySlots(cuda, initial_slots=2)
    logits = torch.randn(4, vocab, device=cuda).bfloat16()
    seqs = [seq_with(SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)) for _ in range(4)]
    seqs[1].token_ids[-1:] = [7, 8, PENDING]  # completion tokens the host knows: added at assignment
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            if step == 2:
                seqs[0].status = SequenceStatus.FINISHED
                seqs[0] = seq_with(SamplingParams(presence_penalty=1.0))  # takes the finished one's slot
            pb = slots.prepare(seqs, [seqs[0].num_tokens - 1, -1, 3, 3] if step == 0 else [3] * 4, vocab)
            x = apply_penalties(logits, pb)
            slots.record(pb, x.argmax(dim=-1))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert slots.num_slots == 4 and slots.counts[slots.slot_of(seqs[1])].sum().item() == 2 + 2


@needs_gpu
def test_penalized_greedy_on_the_gpu_matches_cpu(tiny_model_dir) -> None:
    """float32 on the GPU (CUDA graphs, async scheduling, the fused sampler for the sampled rows beside them) gives
    the CPU's tokens for penalized greedy rows, through preemption."""
    model_dir = str(tiny_model_dir("qwen3"))
    params = [greedy(repetition_penalty=1.3), greedy(), greedy(frequency_penalty=2.0),
              greedy(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=0.8)]
    tight = dict(max_model_len=128, num_kvcache_blocks=8)
    extra = (list(range(900, 920)), SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    prompts, all_params = PROMPTS + [extra[0]], params + [extra[1]]
    cpu = LLM(model_dir, device="cpu", **tight)
    try:
        want = [o.outputs[0].token_ids for o in cpu.generate(prompts, all_params)][:4]
    finally:
        cpu.shutdown()
    llm = LLM(model_dir, device="cuda", dtype="float32", **tight)
    try:
        assert llm.engine.async_scheduling
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, all_params)][:4]
        assert llm.stats().num_preemptions > 0
    finally:
        llm.shutdown()
    assert got == want


@needs_gpu
def test_bf16_rows_without_penalties_are_unchanged_by_penalized_neighbours_on_the_gpu(tiny_model_dir) -> None:
    """bf16 logits: a batch with penalized rows samples from a float32 copy; greedy and seeded rows draw what they
    draw beside the same neighbours without penalties. Not what they draw alone: on the GPU a bf16 row's logits move
    with its step's row count (the GEMM kernels differ per row count), which flips near-tie draws of this random
    model (benchmarks/seed_batch_gpu.py; benchmarks/RESULTS.md)."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cuda", dtype="bfloat16", max_model_len=256,
              num_kvcache_blocks=128)
    try:
        targets = [(PROMPTS[0], greedy()),
                   (PROMPTS[2], SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)),
                   (PROMPTS[3], SamplingParams(temperature=0.8, seed=99, max_tokens=16, ignore_eos=True))]
        results = []
        for penalized in (False, True):
            batch = beside_penalized_neighbours(targets, penalized)
            outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch])
            results.append([outs[i].outputs[0].token_ids for i in (0, 1, 2, 4)])
        plain, beside_penalized = results
        assert beside_penalized[1:] == plain[1:]
        assert beside_penalized[0] != plain[0]  # the neighbours' penalties did act
    finally:
        llm.shutdown()


NO_COMPILE_SCRIPT = '''
import json, os, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a machine's first job: nothing compiled yet
import triton
from nvcli import LLM, SamplingParams

llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=16)
compiled = []
triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["fn"].jit_function.__name__)
prompts = [[i * 10 + j for j in range(40)] for i in range(1, 9)]
params = [SamplingParams(temperature=0.7 if i % 2 else 0.0, seed=i, max_tokens=12, ignore_eos=True,
                         frequency_penalty=0.5 * (i % 3), repetition_penalty=1.0 + 0.1 * (i % 4)) for i in range(8)]
outs = llm.generate(prompts, params)
llm.shutdown()
print(json.dumps({"compiled": compiled, "lens": [len(o.outputs[0].token_ids) for o in outs]}))
'''


@needs_gpu
def test_a_first_job_with_penalties_compiles_no_kernel_mid_run(tiny_model_dir) -> None:
    """A bf16 model's penalized steps sample from a float32 copy: the fused kernels' float32 variant is compiled at
    start-up (startup.warm_up_kernels), not at the job's first penalized step."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", NO_COMPILE_SCRIPT, str(tiny_model_dir("qwen3"))], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["lens"] == [12] * 8
    assert result["compiled"] == []
