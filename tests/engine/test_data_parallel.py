"""Data-parallel replicas on CPU: the same lines as one engine, in the same order; a replica killed mid-job loses and
duplicates nothing; a replica that cannot start fails the engine at once; signals drain every replica."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvcli.config import ConfigError, EngineConfig
from nvcli.engine.data_parallel import DataParallelEngine
from nvcli.engine.llm_engine import LLMEngine
from nvcli.engine.replica import serve
from nvcli.engine.router import BALANCE_SLACK, Router, prefix_keys
from nvcli.jobs.requests import Defaults
from nvcli.jobs.runner import JobOptions, run_job
from nvcli.testing.processes import running

ROOT = Path(__file__).resolve().parents[2]
SHARED = "Summarize the following note in one sentence, keeping every name exactly as written: "


def settings(model: Path, **kw) -> EngineConfig:
    base = dict(model=str(model), device="cpu", num_kvcache_blocks=128, max_model_len=512, max_num_seqs=4)
    return EngineConfig(**{**base, **kw})


def job_lines(n: int) -> bytes:
    lines = []
    for i in range(n):
        prompt = (SHARED if i % 2 else "") + f"note {i}: " + "the quick brown fox jumps " * (i % 5 + 1)
        lines.append({"id": f"l{i}", "prompt": prompt, "max_tokens": 6 + i % 7})
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def run(engine, src: bytes) -> list[dict]:
    out = io.BytesIO()
    opts = JobOptions(defaults=Defaults(sampling={"temperature": 0.0}), handle_sigint=False)
    result = run_job(engine, src.splitlines(keepends=True), out, opts)
    assert result.failed == 0
    return [json.loads(x) for x in out.getvalue().splitlines()]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def reference(model) -> list[dict]:
    engine = LLMEngine(settings(model))
    try:
        return run(engine, job_lines(24))
    finally:
        engine.shutdown()


def strip(lines: list[dict]) -> list[tuple]:
    return [(x["id"], x["text"], x["finish_reason"], x["usage"]["completion_tokens"]) for x in lines]


@pytest.fixture(scope="module")
def two_replicas(model):
    engine = DataParallelEngine(settings(model, data_parallel_size=2))
    yield engine
    engine.shutdown()


def test_two_replicas_give_one_engine_s_lines_in_its_order(two_replicas, reference):
    got = run(two_replicas, job_lines(24))
    per_replica = [s.num_finished for s in two_replicas.stats().replicas]
    assert strip(got) == strip(reference)
    assert all(n > 0 for n in per_replica), per_replica  # both served lines: no static split, no idle replica
    assert sum(per_replica) == 24


def test_queued_requests_abort_without_reaching_a_replica(two_replicas):
    from nvcli.sampling_params import SamplingParams

    engine = two_replicas
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    ids = [engine.add_request([1, 2, 3, i + 4], sp) for i in range(3 * engine.router.window)]
    assert engine.stats().num_waiting >= engine.router.window  # past both windows: held in the front end
    engine.abort(ids[-1])
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert sorted(outs) == sorted(ids)
    assert outs[ids[-1]].outputs[0].finish_reason == "abort"
    assert all(outs[i].outputs[0].finish_reason == "length" for i in ids[:-1])


def test_a_replica_killed_mid_job_loses_and_duplicates_no_line(model, reference):
    engine = DataParallelEngine(settings(model, data_parallel_size=2))
    victim = engine.replica_pids()[1]
    step, killed = engine.step, []

    def step_then_kill():
        outs = step()
        if outs and not killed:  # mid-job: the first lines are done, replica 1 holds others
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
        return outs

    engine.step = step_then_kill  # type: ignore[method-assign]
    try:
        got = run(engine, job_lines(24))
    finally:
        engine.shutdown()
    assert killed and 1 in engine.lost and "SIGKILL" in engine.lost[1]
    assert engine.num_requeued > 0
    assert [x["id"] for x in got] == [f"l{i}" for i in range(24)]  # each id once, in order
    assert strip(got) == strip(reference)  # greedy: the re-served lines are the same lines


def test_the_front_end_queue_and_the_replica_serve_by_priority(model):
    """--scheduling-policy priority across the front end: the requests past the replica's window wait in the front
    end's queue and leave it by (priority, arrival); the replica gets each one's priority. With one sequence at a time
    the queued ones finish in that order."""
    from nvcli.sampling_params import SamplingParams

    engine = DataParallelEngine(settings(model, data_parallel_size=1, max_num_seqs=1, scheduling_policy="priority"))
    try:
        assert engine.router.window == 2
        sp = SamplingParams(temperature=0.0, max_tokens=3)
        priorities = [5, 5, 3, 0, 1, 0]
        ids = [engine.add_request([1, 2, 3, i + 4], sp, priority=p) for i, p in enumerate(priorities)]
        assert [p.request_id for p in engine._queue] == [ids[i] for i in (3, 5, 4, 2)]  # the first two went out
        finished: list[str] = []
        while engine.has_unfinished():
            finished.extend(o.request_id for o in engine.step())
        assert sorted(finished) == sorted(ids) and finished[0] == ids[0]
        assert [rid for rid in finished if rid in ids[2:]] == [ids[i] for i in (3, 5, 4, 2)]
        with pytest.raises(ValueError, match="must be an integer"):
            engine.add_request([1, 2, 3], sp, priority="high")  # type: ignore[arg-type]
    finally:
        engine.shutdown()


def test_a_replica_that_cannot_start_fails_the_engine_at_once(model):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"data-parallel replica \d of 2: --max-model-len=512: the KV cache holds"):
        DataParallelEngine(settings(model, data_parallel_size=2, num_kvcache_blocks=4))
    assert time.monotonic() - t0 < 120


def test_more_gpus_than_visible_names_the_flag(model, monkeypatch):
    monkeypatch.setattr("nvcli.config._cuda_available", lambda: (True, ""))
    monkeypatch.setattr("nvcli.engine.data_parallel._visible_gpus", lambda: ["0", "1"])
    with pytest.raises(ConfigError, match=r"--data-parallel-size=2 x --tensor-parallel-size=2 needs 4 GPUs; 2 are "
                                          r"visible \(lower --dp\)"):
        DataParallelEngine(settings(model, data_parallel_size=2, tensor_parallel_size=2, device="cuda"))


class _FailingEngine:
    def __init__(self) -> None:
        self.added: list[str] = []

    def has_unfinished(self) -> bool:
        return bool(self.added)

    def add_request(self, token_ids, params, request_id, prompt_text, priority):
        self.added.append(request_id)

    def step(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def stats(self):
        return None


def test_a_step_that_raises_tells_the_front_end_before_the_replica_ends():
    sent: list[tuple] = []
    msgs = [[("add", "r1", [1, 2], None, None, 0)]]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        serve(_FailingEngine(), lambda timeout: msgs.pop(0) if msgs else [], sent.append)
    assert sent[-1][0] == "dead" and "CUDA error" in sent[-1][1]


# -- the router ------------------------------------------------------------------------------
def test_router_sends_a_request_to_the_replica_with_fewest_outstanding_tokens():
    r = Router(3, window=4, block_size=16)
    r.assign(0, 5000, [])
    r.assign(1, 100, [])
    assert r.pick([]) == 2
    r.assign(2, 300, [])
    assert r.pick([]) == 1
    r.release(0, 5000)
    assert r.pick([]) == 0


def test_router_window_holds_requests_back_until_a_replica_has_room():
    r = Router(2, window=2, block_size=16)
    for rep in (0, 0, 1, 1):
        r.assign(rep, 10, [])
    assert r.pick([]) is None
    r.release(1, 10)
    assert r.pick([]) == 1


def test_router_keeps_a_shared_prefix_on_its_replica_until_the_load_spreads_it():
    r = Router(2, window=100, block_size=16)
    prompt = list(range(200))
    keys = prefix_keys(prompt, 16)
    assert len(keys) == 4  # 16, 32, 64, 128 tokens
    r.assign(1, 1000, keys)
    assert r.pick(keys) == 1  # affinity beats the idle replica 0 while within the slack
    assert r.pick(prefix_keys(list(range(300, 500)), 16)) == 0  # another prefix: the lightest
    r.assign(1, BALANCE_SLACK[1] + 1, [])
    assert r.pick(keys) == 0  # too far ahead: the prefix spreads to replica 0
    r.assign(0, 10, keys)
    assert r._holders[keys[-1]] == [1, 0]


def test_router_forgets_a_lost_replica():
    r = Router(2, window=4, block_size=16)
    keys = prefix_keys(list(range(40)), 16)
    r.assign(0, 10, keys)
    r.lose(0)
    assert r.pick(keys) == 1
    r.lose(1)
    assert r.pick(keys) is None


def test_prefix_keys_match_only_whole_shared_blocks():
    a = prefix_keys(list(range(40)), 16)
    b = prefix_keys(list(range(33)) + [7] * 10, 16)
    assert a == b  # both share their first 32 tokens; their 33rd differs only past the keys
    assert prefix_keys(list(range(16)), 16) == []  # the last token's block never hits
    assert prefix_keys(list(range(17)), 16) == a[:1]


# -- the command line ------------------------------------------------------------------------
def _children(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            kids = {int(x) for x in task.read_text().split()}
            todo.extend(kids - found)
            found |= kids
    return found


def test_sigterm_drains_every_replica_and_no_process_outlives_the_job(model, tmp_path):
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvcli", "generate", "-", "-o", str(out), "--model", str(model), "--device", "cpu",
         "--num-kvcache-blocks", "128", "--max-model-len", "512", "--dp", "2", "--temperature", "0",
         "--max-tokens", "12", "--quiet"],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stderr is not None
    try:
        proc.stdin.write(job_lines(6))
        proc.stdin.flush()  # the pipe stays open: SIGTERM must drain, not wait for more input
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.1)
        family = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    proc.stdin.close()
    assert rc == 143, err
    assert "Traceback" not in err
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [f"l{i}" for i in range(6)]
    time.sleep(0.5)
    alive = [p for p in family if running(p)]
    assert len(family) >= 2 and not alive, (family, alive)

