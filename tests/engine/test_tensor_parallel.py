"""Tensor parallelism over gloo on CPU: identical greedy output, clean errors, no orphans after a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nvcli import LLM, SamplingParams
from nvcli.config import ConfigError

PROMPTS = [list(range(1000, 1005)), list(range(2000, 2040)), list(range(3000, 3023))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cpu", num_kvcache_blocks=64, max_model_len=256)


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("nv-*")} if Path("/dev/shm").exists() else set()


@pytest.mark.parametrize("arch, async_scheduling", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_tp2_matches_tp1(tiny_model_dir, arch: str, async_scheduling: bool) -> None:
    model = str(tiny_model_dir(arch))
    before = shm_segments()
    ref = LLM(model, **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(model, tensor_parallel_size=2, async_scheduling=async_scheduling, **ENGINE)
    assert llm.engine.async_scheduling == async_scheduling
    procs = list(llm.engine.executor.procs)
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    llm.shutdown()
    assert all(not p.is_alive() for p in procs)
    assert shm_segments() == before


def test_heads_not_divisible_is_rejected(tiny_model_dir) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        LLM(str(tiny_model_dir("qwen3")), tensor_parallel_size=3, **ENGINE)


def test_worker_death_ends_the_job_quickly_without_orphans(tiny_model_dir, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        from nvcli import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM({str(tiny_model_dir("qwen3"))!r}, tensor_parallel_size=2, device="cpu",
                      num_kvcache_blocks=64, max_model_len=256)
            print("WORKER", llm.engine.executor.procs[0].pid, llm.engine.executor.shm.name, flush=True)
            sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            while True:
                llm.generate([list(range(10, 40))] * 4, sp)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("WORKER"), proc.stderr.read()
        _, pid, shm_name = line.split()
        time.sleep(1.0)
        os.kill(int(pid), signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc != 0, err
    assert "worker rank 1 died" in err and "--resume" in err
    assert elapsed < 10
    assert not Path("/dev/shm", shm_name).exists()
    assert "leaked shared_memory" not in err
    alive = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split()
    assert alive == [], "orphan processes left behind"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_end_with_an_engine_that_is_killed(tiny_model_dir, tmp_path: Path) -> None:
    """The engine's process killed outright (SIGKILL, the OOM killer) takes its ranks with it."""
    from nvcli.testing.processes import workers_left_by_a_killed_job

    script = textwrap.dedent(f"""
        import os, signal
        from nvcli import LLM

        if __name__ == "__main__":
            llm = LLM({str(tiny_model_dir("qwen3"))!r}, tensor_parallel_size=2, device="cpu",
                      num_kvcache_blocks=64, max_model_len=256)
            print(*(p.pid for p in llm.engine.executor.procs), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    left, _ = workers_left_by_a_killed_job(script, tmp_path)
    assert left == []


def test_tp2_async_with_preemption_and_chunked_prefill(tiny_model_dir) -> None:
    model = str(tiny_model_dir("qwen3"))
    tight = dict(device="cpu", num_kvcache_blocks=8, max_model_len=128, max_num_batched_tokens=16)
    prompts = PROMPTS + [list(range(4000, 4070))]
    ref = LLM(model, **tight).generate(prompts, GREEDY)
    llm = LLM(model, tensor_parallel_size=2, async_scheduling=True, **tight)
    out = llm.generate(prompts, GREEDY)
    stats = llm.stats()
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0
    assert stats.kv_blocks_used == 0


def test_a_step_with_prompt_chunks_reaches_the_workers_whole() -> None:
    """Rank 0 ships each step to the workers through shared memory: a step with one-token rows ahead of prompt
    chunks must arrive with its decode-row count (the workers split attention on it, in the same CUDA graph as
    rank 0), its in-flight token rows, the rows whose logits it keeps, and every row's ids, positions, slots, lengths and block table."""
    import numpy as np

    from nvcli.config import EngineConfig
    from nvcli.engine.step_input import StepInput
    from nvcli.engine.tp_executor import CMD_STEP, channel_words, pack_step, unpack_step

    config = EngineConfig(model="unused", device="cpu", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    step = StepInput(input_ids=np.array([0, 7, 0, 30, 31, 32, 33], dtype=np.int64),
                     positions=np.array([40, 18, 99, 0, 1, 2, 3], dtype=np.int64),
                     slot_mapping=np.array([88, 34, 195, 300, 301, 302, 303], dtype=np.int64),
                     query_start_loc=[0, 1, 2, 3, 7], seq_lens=[41, 19, 100, 4],
                     block_tables=[[5, 2, 5], [1, 2], [9, 8, 7, 6, 5, 4, 3], [18]], decode_only=False,
                     pending=[(0, 2), (2, 0)], num_decode_rows=3, logit_rows=np.array([3, 4, 5], dtype=np.int64))
    buf = np.full(channel_words(config), -7, dtype=np.int32)  # stale words from an earlier, longer step
    pack_step(buf, step)
    cmd, got = unpack_step(buf)
    assert cmd == CMD_STEP and got is not None
    assert list(got.input_ids) == list(step.input_ids) and list(got.positions) == list(step.positions)
    assert list(got.slot_mapping) == list(step.slot_mapping)
    assert (got.query_start_loc, got.seq_lens) == (step.query_start_loc, step.seq_lens)
    assert (got.decode_only, got.pending, got.num_decode_rows) == (False, step.pending, 3)
    assert list(got.logit_rows) == [3, 4, 5]  # prompt_logprobs rows: every rank runs their LM head
    assert [row[: len(b)] for row, b in zip(got.block_tables, step.block_tables)] == step.block_tables


def test_tp4_matches_tp1(tmp_path: Path) -> None:
    """Four ranks, each with two of 8 query heads and one of 4 KV heads (as a 70B at --tp 8 keeps one)."""
    from nvcli.testing.tiny_models import make_tiny_model

    model = str(make_tiny_model(tmp_path / "tp4", "qwen3", num_attention_heads=8, num_key_value_heads=4,
                                intermediate_size=128, head_dim=16))
    ref = LLM(model, **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(model, tensor_parallel_size=4, **ENGINE)
    try:
        out = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_a_moe_model_without_dense_layers_need_not_split_intermediate_size() -> None:
    """Every layer a mixture of experts: intermediate_size sizes no weight, so it need not divide --tp; with one
    dense layer it must."""
    from nvcli.engine.tp_executor import _check_divisible
    from nvcli.models.model_config import ModelConfig
    from nvcli.testing.tiny_models import tiny_config

    all_moe = ModelConfig.from_dict(tiny_config("qwen3_moe", intermediate_size=99, mlp_only_layers=[]))
    _check_divisible(all_moe, 2)
    one_dense = ModelConfig.from_dict(tiny_config("qwen3_moe", intermediate_size=99, mlp_only_layers=[1]))
    with pytest.raises(ConfigError, match="intermediate_size=99"):
        _check_divisible(one_dense, 2)


@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
def test_a_second_tp_engine_in_one_process_runs_on_the_gpus(tmp_path: Path) -> None:
    """The driver process is rank 0 of every engine it builds: a second engine at --tp 2 (fresh worker processes)
    must start and give the first one's tokens, not wait forever setting up its peer-mapped buffers."""
    from nvcli.testing.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "qwen3", num_attention_heads=8, num_key_value_heads=4)
    script = textwrap.dedent(f"""
        import json
        from nvcli import LLM, SamplingParams
        outs = []
        for _ in range(2):
            llm = LLM({str(model)!r}, device="cuda", dtype="bfloat16", tensor_parallel_size=2, max_model_len=256,
                      num_kvcache_blocks=64, max_num_seqs=8)
            outs.append([o.outputs[0].token_ids for o in llm.generate({PROMPTS!r},
                         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))])
            llm.shutdown()
        print(json.dumps(outs))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first == second and all(len(t) == 12 for t in first)


def _greedy_tp1_then_tp(model: Path, prompts: list[list[int]], max_tokens: list[int], tp: int,
                        **engine) -> tuple[int, list, list]:
    """float32 greedy tokens of the prompts at TP 1, then at --tp `tp` on the GPUs, in a fresh process: an engine
    built after an earlier tensor-parallel one in the same process keeps NCCL for its sums
    (distributed._rendezvous_in_step), which would leave the peer-mapped paths untested. Returns the deferred-sum
    buffer's size in elements as rank 0 (that process) set it up, and both runs' tokens."""
    script = textwrap.dedent(f"""
        import json
        from nvcli import LLM, SamplingParams
        from nvcli.distributed import deferred_capacity
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in {max_tokens!r}]
        outs, capacity = [], None
        for size in (1, {tp}):
            llm = LLM({str(model)!r}, device="cuda", dtype="float32", tensor_parallel_size=size, **{engine!r})
            if size > 1:
                capacity = deferred_capacity()
            outs.append([o.outputs[0].token_ids for o in llm.generate({prompts!r}, params)])
            llm.shutdown()
        print(json.dumps([capacity, outs]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    capacity, (tp1, tpn) = json.loads(proc.stdout.strip().splitlines()[-1])
    return capacity, tp1, tpn


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_on_gpus_matches_tp1_in_float32(tp: int, tmp_path: Path) -> None:
    """float32 greedy at --tp N on N GPUs gives TP 1's tokens, CUDA graphs on, over a streamed job whose decode
    steps run 1-160 rows and most of whose steps carry prompt chunks of up to 1,024 tokens: row-parallel sums
    deferred into the next norm (up to 1,024 / N^2 rows, at TP 2 every step's) and, past them, summed in place in
    the symmetric-memory all-reduce's buffer, in decode and mixed graphs alike."""
    import random

    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from nvcli.testing.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "qwen3", num_attention_heads=8, num_key_value_heads=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(3, 120))] for _ in range(400)]
    max_tokens = [rng.randint(4, 48) for _ in prompts]
    capacity, tp1, tpn = _greedy_tp1_then_tp(model, prompts, max_tokens, tp, num_kvcache_blocks=2048,
                                             max_model_len=256, max_num_batched_tokens=1024, max_num_seqs=160)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    assert capacity == (1024 if tp == 2 else 1024 // tp**2) * hidden
    assert tp1 == tpn and [len(t) for t in tp1] == max_tokens


@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
def test_large_prompt_steps_at_tp2_on_gpus_match_tp1_in_float32(tmp_path: Path) -> None:
    """Prompt steps of up to 8,192 tokens, past the CUDA graphs and the symmetric all-reduce's 2,048 rows, defer
    their row-parallel sums into the next add+RMSNorm at --tp 2 (tp_executor.DEFERRED_SUM_ROWS_TP2): float32 greedy
    gives TP 1's tokens."""
    from nvcli.testing.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "qwen3", num_attention_heads=8, num_key_value_heads=4)
    prompts = [[(7 * i + 13 * j) % 900 + 10 for j in range(700)] for i in range(12)]
    capacity, tp1, tp2 = _greedy_tp1_then_tp(model, prompts, [16] * len(prompts), 2, num_kvcache_blocks=1024,
                                             max_model_len=1024, max_num_batched_tokens=8192)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    assert capacity == 8192 * hidden
    assert tp1 == tp2 and all(len(t) == 16 for t in tp1)
