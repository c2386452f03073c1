"""ModelRunner pieces: the step in flight's tokens fed into the next inputs; inputs built without waiting on the device."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nvcli.attention import plan
from nvcli.attention.plan import shared_prefix_plan
from nvcli.engine.model_runner import ModelRunner
from nvcli.engine.step_input import StepInput


def _step(n: int, pending: list[tuple[int, int]]) -> StepInput:
    return StepInput([0] * n, list(range(n)), list(range(n)), list(range(n + 1)), [1] * n, [[0]] * n, True, pending)


def test_feed_back_identity_and_permuted_rows() -> None:
    """Async scheduling: the next step's inputs take the tokens the step in flight samples. Steady decode
    (row i continues row i) and a reshuffled batch (rows dropped, reordered, a new prompt row without a
    pending token) both land the right token in the right row and leave the other rows alone."""
    runner = SimpleNamespace(device=torch.device("cpu"), prev_tokens=torch.tensor([11, 22, 33, 44]))
    ids = torch.full((4,), -1, dtype=torch.int64)
    ModelRunner._feed_back(runner, ids, _step(4, [(0, 0), (1, 1), (2, 2), (3, 3)]))
    assert ids.tolist() == [11, 22, 33, 44]

    ids = torch.full((3,), -1, dtype=torch.int64)
    ModelRunner._feed_back(runner, ids, _step(3, [(0, 3), (2, 1)]))  # row 1: a new prompt, nothing pending
    assert ids.tolist() == [44, -1, 22]

    ids = torch.full((2,), -1, dtype=torch.int64)
    ModelRunner._feed_back(runner, ids, _step(2, [(0, 0), (1, 2)]))  # looks steady at first, is not
    assert ids.tolist() == [11, 33]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host/device overlap needs a GPU")
def test_step_inputs_do_not_wait_for_the_device(tiny_model_dir) -> None:
    """Async scheduling builds step N+1's inputs while step N runs, so building them must not wait for the device
    (CUDA may sync the stream to stage a copy from pageable memory; every input is uploaded from pinned memory):
    here the device is kept busy for ~0.5 s and building a prefill step's tensors must return long before."""
    from nvcli import LLM

    llm = LLM(str(tiny_model_dir("qwen3")), device="cuda", dtype="float32", max_model_len=512, num_kvcache_blocks=64,
              enforce_eager=True)
    try:
        runner = llm.engine.executor.runner
        lens = [40, 33]
        qsl = [0, 40, 73]
        step = StepInput([1] * 73, [p for n in lens for p in range(n)], [-1] * 73, qsl, lens, [[0, 1, 2], [3, 4, 5]],
                         False)
        runner.eager_inputs(step)  # pinned-memory pools warm
        torch.cuda.synchronize()
        torch.cuda._sleep(int(0.5 * _cycles_per_second()))
        t0 = time.perf_counter()
        _, _, meta = runner.eager_inputs(step)
        elapsed = time.perf_counter() - t0
        assert elapsed < 0.25, f"building the step's tensors waited {elapsed:.3f} s for the device"
        torch.cuda.synchronize()
        assert meta.block_tables.tolist() == [[0, 1, 2], [3, 4, 5]]
    finally:
        llm.shutdown()


def _cycles_per_second() -> float:
    """GPU clock cycles per second, measured (torch.cuda._sleep counts cycles)."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1000)


def _per_token_reference(batch, block_size: int, prev_rows: dict[int, int]) -> tuple[list, list, list, list]:
    """The step's columns written out token by token."""
    ids, pos, slots, pending = [], [], [], []
    for seq, start, n in zip(batch.seqs, batch.start, batch.num_new_tokens):
        for p in range(start, start + n):
            token = seq.token_ids[p]
            if token == -1:
                pending.append((len(ids), prev_rows[seq.seq_id]))
                token = 0
            ids.append(token)
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
    return ids, pos, slots, pending


def test_step_columns_of_prompt_chunks_and_decodes() -> None:
    """A step mixing a prompt's later chunk (starting mid-block), a whole prompt and a decode row whose token is
    still in flight (the array path), and a decode-only step (the list path), give every token its id, position
    and cache slot, and every in-flight token its pending row."""
    from nvcli.engine.block_manager import BlockManager
    from nvcli.engine.scheduler import Scheduler
    from nvcli.engine.sequence import Sequence
    from nvcli.engine.step_input import build_step_input
    from nvcli.sampling_params import SamplingParams

    bs = 4
    sched = Scheduler(BlockManager(64, bs, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=23,
                      max_model_len=128)
    seqs = [Sequence(list(range(100 * i + 1, 100 * i + 1 + n)), SamplingParams(max_tokens=5, ignore_eos=True), bs)
            for i, n in enumerate([9, 30, 6])]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()  # 9 + 14 of 30 tokens: the second prompt is chunked mid-block
    assert first.num_new_tokens == [9, 14]
    prev_rows = {s.seq_id: i for i, s in enumerate(first.seqs)}
    second = sched.schedule()  # a decode of seq 0 (token in flight), 16 more of seq 1, 6 of seq 2
    assert second.num_new_tokens == [1, 16, 6] and not second.is_decode_only
    step = build_step_input(second, bs, prev_rows)
    ids, pos, slots, pending = _per_token_reference(second, bs, prev_rows)
    assert list(step.input_ids) == ids and list(step.positions) == pos and list(step.slot_mapping) == slots
    assert step.pending == pending == [(0, 0)]
    assert step.query_start_loc == [0, 1, 17, 23] and step.seq_lens == [10, 30, 6] and step.num_decode_rows == 1

    sched.postprocess(first, [7, 0])
    prev_rows = {s.seq_id: i for i, s in enumerate(second.seqs)}
    third = sched.schedule()  # while the second step is in flight: every row waits for its token
    assert third.is_decode_only
    step = build_step_input(third, bs, prev_rows)
    ids, pos, slots, pending = _per_token_reference(third, bs, prev_rows)
    assert (step.input_ids, step.positions, step.slot_mapping, step.pending) == (ids, pos, slots, pending)
    assert step.pending == [(0, 0), (1, 1), (2, 2)]


def test_step_columns_of_many_decode_rows_beside_a_prompt() -> None:
    """A long job's usual step: several running decodes (tokens known, and one still in flight) lead, a new prompt
    follows. The one-token rows are gathered in one pass; each must still get its own id, position, slot and
    length, and the decode-row count must cover exactly them."""
    from nvcli.engine.block_manager import BlockManager
    from nvcli.engine.scheduler import Scheduler
    from nvcli.engine.sequence import Sequence
    from nvcli.engine.step_input import build_step_input
    from nvcli.sampling_params import SamplingParams

    bs = 4
    sched = Scheduler(BlockManager(64, bs, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=32,
                      max_model_len=128)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    running = [Sequence(list(range(100 * i + 1, 100 * i + 1 + n)), sp, bs) for i, n in enumerate([3, 4, 5, 7])]
    for s in running:
        sched.add(s)
    first = sched.schedule()
    sched.postprocess(first, [11, 12, 13, 14])  # every first token known
    second = sched.schedule()  # four decodes: position = prompt length
    prev_rows = {s.seq_id: i for i, s in enumerate(second.seqs)}
    sched.postprocess(second, [21, 22, 23, 24])
    late = Sequence(list(range(900, 913)), sp, bs)
    sched.add(late)
    third = sched.schedule()  # four decodes (tokens known) + the new prompt's 13 tokens
    assert third.num_new_tokens == [1, 1, 1, 1, 13] and not third.is_decode_only
    third.seqs[2].token_ids[third.start[2]] = -1  # as if its token were still in flight on row 2 of `second`
    step = build_step_input(third, bs, prev_rows)
    ids, pos, slots, pending = _per_token_reference(third, bs, prev_rows)
    assert list(step.input_ids) == ids and list(step.positions) == pos and list(step.slot_mapping) == slots
    assert list(step.input_ids[:4]) == [21, 22, 0, 24] and step.pending == pending == [(2, 2)]
    assert step.seq_lens == [5, 6, 7, 9, 13] and step.query_start_loc == [0, 1, 2, 3, 4, 17]
    assert step.num_decode_rows == 4


def test_importing_the_engine_decorates_no_kernel() -> None:
    """The CPU machine runs the kernels through Triton's interpreter, switched on before the first `@triton.jit`
    decoration (tests/kernels/conftest.py). Test modules import the engine first, so importing it (CLI, LLM, engine,
    runner, TP executor, models) must decorate no kernel: one module-level kernel import made 220 kernel tests fail
    in CI."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import nvcli.cli, nvcli.llm, nvcli.engine.llm_engine, nvcli.engine.model_runner, nvcli.engine.tp_executor\n"
        "import nvcli.models.llama\n"
        "from triton.runtime.jit import JITFunction\n"
        "print([n for n, m in list(sys.modules.items()) if n.startswith('nvcli')\n"
        "       and any(isinstance(v, JITFunction) for v in vars(m).values())])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_dry_pass_runs_the_first_decoder_layers_then_all_again(tmp_path) -> None:
    """first_decoder_layers (compile-ahead's dry pass): within it the decoder holds only its first n layers, and
    all of them again afterwards, also when the pass fails; a model of n layers or fewer stays whole."""
    from nvcli.engine.startup import first_decoder_layers
    from nvcli.models.model_config import load_model_config
    from nvcli.models.registry import model_class
    from nvcli.testing.tiny_models import make_tiny_model

    model_config = load_model_config(make_tiny_model(tmp_path / "four", "qwen3", num_hidden_layers=4))
    model = model_class(model_config)(model_config)
    layers = list(model.model.layers)
    with first_decoder_layers(model, 2):
        assert list(model.model.layers) == layers[:2]
    assert list(model.model.layers) == layers
    with pytest.raises(RuntimeError), first_decoder_layers(model, 2):
        raise RuntimeError("a dry pass that fails")
    assert list(model.model.layers) == layers
    with first_decoder_layers(model, 4):
        assert list(model.model.layers) == layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="KV sizing measures device memory")
def test_the_kv_cache_leaves_room_for_a_scoring_step(tiny_model_dir) -> None:
    """A scoring job (prompt_logprobs) with few sequences: its steps turn up to 16k prompt positions into logits a
    chunk of 256 MB at a time and reduce each to logprobs, ranks and 20 alternatives, beside the step's own sampled
    logits. With 8 sequences there is little to sample, so only a profiled scoring chunk keeps that step inside
    --gpu-memory-utilization."""
    from nvcli import LLM, SamplingParams

    util = 0.5
    llm = LLM(str(tiny_model_dir("qwen3")), device="cuda", max_model_len=2048, max_num_seqs=8,
              max_num_batched_tokens=16384, gpu_memory_utilization=util)
    try:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()  # the CUDA context, cuBLAS: not torch's allocator
        torch.cuda.reset_peak_memory_stats()
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20)
        prompts = [[(7 * i + j) % 150_000 for j in range(2000)] for i in range(8)]
        outs = llm.generate(prompts, sp)
        assert all(len(o.prompt_logprobs) == 2000 for o in outs)
        assert torch.cuda.max_memory_allocated() + outside <= util * total
    finally:
        llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="KV sizing measures device memory")
def test_the_kv_cache_leaves_room_for_a_step_that_samples_with_everything(tiny_model_dir) -> None:
    """KV sizing gives the cache what --gpu-memory-utilization leaves after a worst-case step. A step whose 256 rows
    all ask for logit_bias, the penalties, top-k / top-p / min-p and 20 logprobs samples from float32 copies of its
    logits and reads a penalty pool of 256 slots ([256, 151,936] int32 and bool): half a GB that the profile run must
    have counted, or a job near --gpu-memory-utilization 1 runs out of memory at its first such step."""
    from nvcli import LLM, SamplingParams

    util = 0.5
    llm = LLM(str(tiny_model_dir("qwen3")), device="cuda", max_model_len=512, gpu_memory_utilization=util)
    try:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()  # the CUDA context, cuBLAS: not torch's allocator
        torch.cuda.reset_peak_memory_stats()
        sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05, logit_bias={7: 1.0}, logprobs=20,
                            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, max_tokens=3,
                            ignore_eos=True)
        outs = llm.generate([[1000 + i, 2000 + i, 3000 + i] for i in range(256)], sp)
        assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
        assert llm.engine.executor.runner.sampling.penalty_slots.num_slots >= 256  # the pool did grow to the batch
        assert torch.cuda.max_memory_allocated() + outside <= util * total
    finally:
        llm.shutdown()


def _shared_tables(rows: int, shared_pages: int, own_pages: int) -> np.ndarray:
    """Tables whose first shared_pages entries are the same blocks in every row, then blocks of each row's own."""
    tables = np.zeros((rows, shared_pages + own_pages + 2), dtype=np.int32)
    tables[:, :shared_pages] = np.arange(shared_pages)
    tables[:, shared_pages:shared_pages + own_pages] = (1000 + np.arange(rows * own_pages)).reshape(rows, own_pages)
    return tables


def test_shared_prefix_plan_finds_the_pages_every_group_shares() -> None:
    rows = plan.SHARED_PREFIX_MIN_ROWS
    tables = _shared_tables(rows, 32, 2)
    lens = np.full(rows, 32 * 16 + 20, dtype=np.int32)
    lens[7] += 5  # longest first among rows that begin with the same page
    order, shared = shared_prefix_plan(tables, lens, 16, 8)
    assert order[0] == 7 and sorted(order) == list(range(rows))
    assert list(shared) == [512] * (rows // 8)
    tables[5, 30] = 7  # one row leaves the shared run at page 30: its group shares 30 pages, the others 32
    order, shared = shared_prefix_plan(tables, lens, 16, 8)
    group_of_5 = list(order).index(5) // 8
    assert [int(x) for x in shared] == [480 if g == group_of_5 else 512 for g in range(rows // 8)]


def test_shared_prefix_plan_counts_only_pages_full_in_every_row_of_a_group() -> None:
    rows = plan.SHARED_PREFIX_MIN_ROWS
    tables = _shared_tables(rows, 32, 2)  # the tables share more pages than the shortest row has filled
    lens = np.full(rows, 600, dtype=np.int32)
    lens[3] = 20 * 16  # this row's 20th page holds its last token: 19 pages are whole and leave it a token
    order, shared = shared_prefix_plan(tables, lens, 16, 8)
    assert order[-1] == 3  # shortest last
    assert list(shared) == [32 * 16] * 3 + [19 * 16]  # the group holding row 3 stops at its 19 whole pages


@pytest.mark.parametrize("common_header", [False, True])
def test_several_instructions_group_their_own_rows(common_header: bool) -> None:
    """40 rows behind two instructions, interleaved as a job's lines may be: sorted by their pages, each group of 8
    holds one instruction's rows (but the group that straddles both) and reads that instruction's pages. With a
    common header (a chat template's first pages, the same blocks in every row) the instructions part at page 2."""
    rows, seqs = 40, 8
    tables = np.zeros((rows, 50), dtype=np.int32)
    lens = np.empty(rows, dtype=np.int32)
    for r in range(rows):
        pages = 20 if r % 2 else 30  # instruction A: 20 pages at blocks 100.., B: 30 pages at blocks 200..
        tables[r, :pages] = (100 if r % 2 else 200) + np.arange(pages)
        if common_header:
            tables[r, :2] = [50, 51]
        tables[r, pages:pages + 3] = 1000 + 3 * r + np.arange(3)
        lens[r] = pages * 16 + 40
    order, shared = shared_prefix_plan(tables, lens, 16, seqs)
    groups = [sorted({int(tables[r, 2]) for r in order[g * seqs:(g + 1) * seqs]}) for g in range(rows // seqs)]
    assert groups == [[102]] * 2 + [[102, 202]] + [[202]] * 2
    assert list(shared) == [320, 320, 0, 480, 480]  # the straddling group: at most the 2 header pages, under 256


@pytest.mark.parametrize("case", ["few rows", "short prefix", "prefix under half the KV", "no shared page"])
def test_shared_prefix_plan_declines(case: str) -> None:
    rows = plan.SHARED_PREFIX_MIN_ROWS - (1 if case == "few rows" else 0)
    shared_pages = {"short prefix": plan.SHARED_PREFIX_MIN_TOKENS // 16 - 1}.get(case, 32)
    tables = _shared_tables(rows, shared_pages, 40)
    lens = np.full(rows, shared_pages * 16 + 30, dtype=np.int32)
    if case == "prefix under half the KV":
        lens[:] = shared_pages * 16 + 33 * 16
    if case == "no shared page":
        tables[:, 0] = np.arange(rows)  # every row its own first page
    assert shared_prefix_plan(tables, lens, 16, 8) is None


def test_a_max_model_len_past_the_cpu_cache_names_the_flag_that_makes_it_larger(tiny_model_dir) -> None:
    """On a CPU the KV cache's size is --cpu-kvcache-space's (cpu_kvcache_space_gib from Python): the error says so."""
    from nvcli import LLM
    from nvcli.config import ConfigError

    with pytest.raises(ConfigError, match="cpu_kvcache_space|cpu-kvcache-space"):
        LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=512, num_kvcache_blocks=4)
