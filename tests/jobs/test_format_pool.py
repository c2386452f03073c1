"""Lines with logprobs formatted in worker processes (jobs/format_pool.py): the same lines the main thread writes,
in input order, and none lost when a worker dies or the pool cannot start. Each test starts real processes (~2 s)."""

from __future__ import annotations

import io
import json
import os
import re

import pytest
from fake_engine import FakeEngine, jsonl

from nvcli.jobs import runner
from nvcli.jobs.format_pool import FormatPool, default_workers
from nvcli.jobs.requests import Defaults
from nvcli.jobs.runner import JobOptions, JobResult

MSGS = [{"role": "user", "content": "hi"}]
DATA = jsonl(
    *[{"id": f"n{i}", "prompt": f"p{i}", "max_tokens": 3 + i % 5, "logprobs": 1} for i in range(16)],
    {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": MSGS, "max_tokens": 3, "logprobs": True, "top_logprobs": 1}},
    {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "abc", "max_tokens": 2, "logprobs": 1, "echo": True}},
    {"id": "plain", "prompt": "no logprobs"},
    {"id": "bad", "prompt": 3},
)


def _normalized(raw: bytes) -> list[str]:
    """Output lines with what differs between runs (ids, request ids, creation times) blanked."""
    text = re.sub(rb'"(chatcmpl|cmpl)-[0-9a-f]+"', rb'"\1-X"', raw)
    text = re.sub(rb'"request_id":"[^"]+"', rb'"request_id":"X"', text)
    text = re.sub(rb'"created":\d+', rb'"created":0', text)
    return text.decode().splitlines()


def _job(engine: FakeEngine, workers: int, pool: FormatPool | None = None) -> tuple[JobResult, list[str]]:
    dst = io.BytesIO()
    opts = JobOptions(defaults=Defaults(sampling={"max_tokens": 4, "temperature": 0}), handle_sigint=False,
                      format_workers=workers)
    job = runner._Job(engine, io.BytesIO(DATA), dst, opts, None, None)
    if pool is not None:
        job.pool = pool
    return job.run(), _normalized(dst.getvalue())


def _started_pool(engine: FakeEngine, workers: int = 2) -> FormatPool:
    from nvcli.jobs.formatting import FormatContext

    pool = FormatPool(FormatContext(model_name="model", tokenizer=engine.tokenizer), workers)
    assert pool.ready.wait(60), pool.error
    return pool


def test_the_pool_writes_the_main_thread_s_lines() -> None:
    """Every line with logprobs (native, chat and completions with echo) comes from the pool, and the job writes
    what formatting on the main thread writes, line for line in input order; lines without logprobs and error lines
    are the main thread's."""
    want_result, want = _job(FakeEngine(max_num_seqs=3), workers=0)
    engine = FakeEngine(max_num_seqs=3)
    result, got = _job(engine, workers=2, pool=_started_pool(engine))
    assert got == want
    assert result.formatted_apart == 18 and want_result.formatted_apart == 0
    assert result.written == want_result.written == 20 and result.exit_code == want_result.exit_code


class _KillsItsReader:
    """Unpickled in a worker, it ends that process (a worker that dies mid-job: out of memory, killed)."""

    def __reduce__(self):
        return os._exit, (3,)


class _DeadlyEngine(FakeEngine):
    def step(self):
        outs = super().step()
        for out in outs:
            if out.request_id == "nv-5":  # the reader's request id of line n5 (its sixth output line)
                out.metrics["poison"] = _KillsItsReader()  # type: ignore[assignment]
        return outs


def test_a_worker_that_dies_costs_no_line() -> None:
    """A worker dies while it holds a line: that line and every later one are formatted on the main thread, and the
    job writes the same lines as without the pool."""
    want_result, want = _job(FakeEngine(max_num_seqs=3), workers=0)
    engine = _DeadlyEngine(max_num_seqs=3)
    result, got = _job(engine, workers=2, pool=_started_pool(engine))
    assert got == want
    assert 0 < result.formatted_apart < 18 and result.exit_code == want_result.exit_code


def test_a_pool_that_cannot_start_costs_no_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes that fail to start (here: their initializer raises) leave the main thread formatting."""
    from nvcli.jobs import format_pool

    def no_start(self, workers):
        self.error = OSError("cannot start processes")

    monkeypatch.setattr(format_pool.FormatPool, "_start", no_start)
    _, want = _job(FakeEngine(max_num_seqs=3), workers=0)
    result, got = _job(FakeEngine(max_num_seqs=3), workers=2)
    assert got == want and result.formatted_apart == 0


class _WaitsForThePool(FakeEngine):
    """The step after the job's first lines with logprobs finished waits for the pool's workers to start (the pool
    started with the first such line's request): those lines were submitted before then."""

    def __init__(self) -> None:
        super().__init__(max_num_seqs=3)
        self.job: runner._Job | None = None
        self.waited = False

    def step(self):
        pool = self.job.pool if self.job is not None else None
        if pool is not None and pool._waiting and not self.waited:
            self.waited = True
            assert not pool.ready.is_set()
            assert pool.ready.wait(60), pool.error
        return super().step()


def test_lines_finished_before_the_workers_start_wait_for_them() -> None:
    """A scoring job's first lines finish while the workers are still starting (1-3 s): they wait for them, and the
    main thread, which shares the GIL with the engine's step loop, formats none of them."""
    want_result, want = _job(FakeEngine(max_num_seqs=3), workers=0)
    engine = _WaitsForThePool()
    dst = io.BytesIO()
    opts = JobOptions(defaults=Defaults(sampling={"max_tokens": 4, "temperature": 0}), handle_sigint=False,
                      format_workers=2)
    engine.job = runner._Job(engine, io.BytesIO(DATA), dst, opts, None, None)
    result = engine.job.run()
    assert _normalized(dst.getvalue()) == want
    assert result.formatted_apart == 18 and result.written == want_result.written


class _SeesThePool(FakeEngine):
    def __init__(self) -> None:
        super().__init__(max_num_seqs=3)
        self.job: runner._Job | None = None
        self.pool_at_first_output: bool | None = None

    def step(self):
        started = self.job is not None and self.job.pool is not None
        outs = super().step()
        if outs and self.pool_at_first_output is None:
            self.pool_at_first_output = started
        return outs


def test_the_pool_starts_with_the_first_request_that_asks_for_logprobs() -> None:
    """The workers start while that request runs, not when its line is done (a generation job's first line may take
    seconds): its line need not wait for them as long."""
    engine = _SeesThePool()
    opts = JobOptions(defaults=Defaults(sampling={"max_tokens": 4, "temperature": 0}), handle_sigint=False,
                      format_workers=1)
    engine.job = runner._Job(engine, io.BytesIO(DATA), io.BytesIO(), opts, None, None)
    assert engine.job.run().written == 20
    assert engine.pool_at_first_output is True


def test_a_job_does_not_wait_for_workers_that_have_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the engine is idle, the main thread formats the lines still waiting for the workers to start: a small
    job does not wait seconds for them."""
    import threading
    import time

    from nvcli.jobs import format_pool

    started = threading.Event()
    monkeypatch.setattr(format_pool.FormatPool, "_start", lambda self, workers: started.wait(30))
    try:
        t0 = time.monotonic()
        result, got = _job(FakeEngine(max_num_seqs=3), workers=2)
        assert time.monotonic() - t0 < 10
    finally:
        started.set()
    assert got == _job(FakeEngine(max_num_seqs=3), workers=0)[1] and result.formatted_apart == 0


def test_lines_waiting_for_a_pool_that_fails_to_start_cost_nothing() -> None:
    """The workers die as they start (here: their context cannot be unpickled) while lines wait for them: those
    lines and every later one are formatted on the main thread."""
    from nvcli.jobs.formatting import FormatContext

    _, want = _job(FakeEngine(max_num_seqs=3), workers=0)
    pool = FormatPool(FormatContext(model_name="model", tokenizer=_KillsItsReader()), 2)
    result, got = _job(FakeEngine(max_num_seqs=3, step_delay=0.05), workers=2, pool=pool)
    assert pool.error is not None
    assert got == want and result.formatted_apart == 0


def test_default_workers_only_beside_a_gpu_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_workers("cuda") == 4 and default_workers("cpu") == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert default_workers("cuda") == 0


def test_the_workers_tokenizer_decodes_as_the_model_s() -> None:
    """Workers get Qwen3's tokenizer as a DecodeOnly (its Rust tokenizer: no transformers import in the worker), and
    it decodes as the tokenizer does: single tokens (logprobs' token texts), whole prompts (echo), special tokens,
    byte-level pieces of split characters."""
    import pickle
    import random

    from nvcli.jobs.format_pool import DecodeOnly, decode_only
    from nvcli.models.tokenizer import load_tokenizer
    from nvcli.testing.tiny_models import qwen_tokenizer_dir

    tok = load_tokenizer(qwen_tokenizer_dir())
    sent = pickle.loads(pickle.dumps(decode_only(tok)))
    assert isinstance(sent, DecodeOnly)
    rng = random.Random(0)
    vocab = len(tok)
    cases = [[t] for t in range(0, vocab, 997)] + [[vocab - 1], [151643], [151644, 872, 198]]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(200)]
    cases += [tok.encode("naïve café 日本語 🙂 <think>\n</think> x")]
    for ids in cases:
        assert sent.decode(ids) == tok.decode(ids), ids


def test_a_tokenizer_that_cleans_up_is_sent_whole() -> None:
    from nvcli.jobs.format_pool import decode_only
    from nvcli.models.tokenizer import load_tokenizer
    from nvcli.testing.tiny_models import qwen_tokenizer_dir

    tok = load_tokenizer(qwen_tokenizer_dir())
    tok.clean_up_tokenization_spaces = True
    assert decode_only(tok) is tok
    fake = FakeEngine().tokenizer
    assert decode_only(fake) is fake


def _stdout_is_stderr() -> bool:
    """In a worker: its stdout and stderr are one file (where the job's stderr went when the pool's server process
    started; a test's captured files then are an earlier test's)."""
    return os.path.samestat(os.fstat(1), os.fstat(2))


def test_a_worker_prints_nothing_to_the_job_s_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    """`nv generate` writes its lines to stdout by default: a worker's stdout is its stderr, which differs from the
    job's stdout here (pytest captures the two apart)."""
    from nvcli.jobs.formatting import FormatContext

    assert not os.path.samestat(os.fstat(1), os.fstat(2))
    pool = FormatPool(FormatContext(model_name="model"), 1)
    try:
        assert pool.ready.wait(60), pool.error
        assert pool.executor.submit(_stdout_is_stderr).result(timeout=60) is True
    finally:
        pool.shutdown()


def test_engine_logprobs_format_in_a_worker_as_on_the_main_thread() -> None:
    """The engine hands prompt logprobs whose texts are its vocabulary's by id, and a pickled copy leaves that
    vocabulary behind: a worker reads the texts from the copy in its context (as a job gives it the engine's) and
    writes the same lines, ids past the tokenizer's vocabulary (a model's padding) included."""
    import numpy as np
    import torch

    from nvcli.engine.sampler import TokenLogprobs, pack_columns
    from nvcli.jobs.formatting import FormatContext, result_line
    from nvcli.jobs.jsonio import dumps
    from nvcli.jobs.requests import parse_line
    from nvcli.models.tokenizer import extend_vocabulary, load_tokenizer, vocabulary_texts
    from nvcli.outputs import CompletionOutput, FlatLogprobs, RequestOutput
    from nvcli.testing.tiny_models import QWEN_VOCAB, qwen_tokenizer_dir

    tok = load_tokenizer(qwen_tokenizer_dir())
    prompt = tok.encode("naïve café 日本語 🙂 x") + [QWEN_VOCAB - 2]
    n, k = len(prompt) - 1, 3
    g = torch.Generator().manual_seed(0)
    packed = torch.empty((n, 3 + 2 * k), dtype=torch.int32)
    top_ids = torch.randint(0, QWEN_VOCAB, (n, k), generator=g)
    top_ids[0, 0] = QWEN_VOCAB - 1
    pack_columns(packed, token_ids=torch.tensor(prompt[1:]), chosen=-torch.rand(n, generator=g),
                 ranks=torch.randint(1, 9, (n,), generator=g, dtype=torch.int32),
                 top_values=-torch.rand(n, k, generator=g).sort(dim=1).values, top_ids=top_ids)
    lines = [{"id": "native", "prompt_token_ids": prompt, "prompt_logprobs": k, "max_tokens": 1},
             {"custom_id": "echo", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": prompt, "echo": True, "logprobs": k, "max_tokens": 0}}]
    vocabulary = extend_vocabulary(vocabulary_texts(tok), tok, QWEN_VOCAB - 1)  # LLMEngine.token_texts' table
    ctx = FormatContext(model_name="model", tokenizer=tok, created=0, vocabulary=vocabulary)
    pool = FormatPool(ctx, 1)
    try:
        assert pool.ready.wait(60), pool.error
        for line in lines:
            req = parse_line(json.dumps(line), 0, Defaults())
            flat = FlatLogprobs()
            flat.append_empty()
            flat.extend_from(TokenLogprobs(packed).flat(np.full(n, k)), 0, n)
            flat.use_vocabulary(vocabulary)
            out = RequestOutput("r", None, prompt, [CompletionOutput(0, "", [], "length")], True, prompt_logprobs=flat)
            here = dumps(result_line(req, out, ctx))
            there = pool.submit(req, out).result(timeout=60)
            assert _normalized(there) == _normalized(here)
            assert tok.decode([QWEN_VOCAB - 1]) == "" and '"token_id:' not in here.decode()
    finally:
        pool.shutdown()


_KILLED_JOB = """
import os, signal
from nvcli.jobs.format_pool import FormatPool
from nvcli.jobs.formatting import FormatContext
if __name__ == "__main__":
    pool = FormatPool(FormatContext("m"), 2)
    assert pool.ready.wait(60), pool.error
    print(*pool.executor._processes, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_end_with_a_job_that_is_killed(tmp_path) -> None:
    """A job killed outright (SIGKILL, the OOM killer) takes its workers with it, and its stdout closes: before, the
    workers waited on their queue forever, and multiprocessing's resource tracker held the job's stdout, so a
    pipeline reading it never ended."""
    from nvcli.testing.processes import workers_left_by_a_killed_job

    left, rest = workers_left_by_a_killed_job(_KILLED_JOB, tmp_path)
    assert left == [] and rest == b""
