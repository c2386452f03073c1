"""`nv bench` on CPU with a tiny model: vLLM's summary lines, its JSON keys, the workload, bad flags."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from nvcli.bench import make_workload
from nvcli.cli import app


def test_workload_is_nano_vllm_bench() -> None:
    work = make_workload(256, (100, 1024), (100, 1024), seed=0)
    assert (work.prompt_tokens, work.output_tokens) == (142_827, 133_966)  # the DESIGN workload's totals (benchmarks/RESULTS.md)
    assert all(p.ignore_eos and p.temperature == 0.6 for p in work.params)


def test_bench_prints_vllm_lines_and_json(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--model", str(tiny_model_dir("qwen3")), "--device", "cpu", "--num-prompts", "4",
        "--input-len", "8-16", "--output-len", "4", "--max-model-len", "128", "--num-kvcache-blocks", "64",
        "--output-json", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    assert "Throughput: " in result.stdout and "output tokens/s" in result.stdout
    assert "Total num output tokens:  16" in result.stdout
    data = json.loads(out.read_text())
    for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"):
        assert key in data
    assert data["num_requests"] == 4 and data["total_num_output_tokens"] == 16


def test_bench_latency_mode(tiny_model_dir) -> None:
    result = CliRunner().invoke(app, [
        "bench", "--model", str(tiny_model_dir("qwen3")), "--device", "cpu", "--latency",
        "--latency-input-len", "16", "--latency-output-len", "8", "--max-model-len", "128",
        "--num-kvcache-blocks", "64", "--quiet",
    ])
    assert result.exit_code == 0, result.output
    assert "Time per output token:" in result.stdout


def test_bench_latency_refuses_data_parallelism(tiny_model_dir) -> None:
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_model_dir("qwen3")), "--device", "cpu", "--latency",
                                      "--dp", "2"])
    assert result.exit_code == 2
    assert "--latency times one request on one replica" in result.output


def test_bench_rejects_a_bad_range() -> None:
    result = CliRunner().invoke(app, ["bench", "--input-len", "50-10", "--device", "cpu"])
    assert result.exit_code == 2
    assert "--input-len" in result.output


def test_latency_samples_as_asked(tiny_model_dir) -> None:
    from nvcli import LLM, SamplingParams
    from nvcli.bench import latency

    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=64, max_model_len=128)
    asked = []
    add_request = llm.engine.add_request
    llm.engine.add_request = lambda prompt, sp, **kw: (asked.append(sp), add_request(prompt, sp, **kw))[1]
    qwen3 = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    res = latency(llm.engine, 16, 8, repeats=2, sampling=qwen3)
    assert [(sp.temperature, sp.top_k, sp.top_p, sp.ignore_eos) for sp in asked] == [(0.6, 20, 0.95, True)] * 3
    assert [sp.max_tokens for sp in asked] == [8, 8, 8]  # the warm-up request, then the two timed ones
    assert res["output_len"] == 8 and len(res["latencies"]) == 2


def test_cpu_kvcache_space_bounds_the_cpu_kv_cache(tiny_model_dir, tmp_path) -> None:
    """--cpu-kvcache-space GIB (vLLM's VLLM_CPU_KVCACHE_SPACE): the cache holds max-model-len x max-num-seqs tokens
    up to that many bytes."""
    model = tiny_model_dir("qwen3")
    cfg = json.loads((model / "config.json").read_text())
    per_block = 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # float32
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--model", str(model), "--device", "cpu", "--num-prompts", "1", "--input-len", "4",
        "--output-len", "2", "--max-model-len", "64", "--max-num-seqs", "512", "--cpu-kvcache-space", "0.001",
        "--output-json", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["kv_blocks"] == min(4 * 512, int(0.001 * 2**30) // per_block)


def test_bench_progress_lines_say_nv_bench_once(tiny_model_dir) -> None:
    result = CliRunner().invoke(app, [
        "bench", "--model", str(tiny_model_dir("qwen3")), "--device", "cpu", "--num-prompts", "2",
        "--input-len", "4", "--output-len", "2", "--max-model-len", "64", "--num-kvcache-blocks", "16",
    ])
    assert result.exit_code == 0, result.output
    assert "nv bench: warming up" in result.stderr and "nv: nv bench" not in result.stderr
