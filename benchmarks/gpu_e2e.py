"""End-to-end checks and timings on one GPU, in one run (see benchmarks/RESULTS.md).

    PYTHONPATH=. python3 benchmarks/gpu_e2e.py [--sections correctness,throughput,...] [--repeats 3]

Sections (default correctness,throughput,latency,fp8):
- correctness: tiny random Qwen3 / Llama, greedy. GPU float32 (eager and CUDA graphs) vs the CPU float32 path, GPU
  bf16 vs CPU float32 (token agreement), GPU bf16 vs HF transformers on the GPU.
- throughput: the DESIGN workload (benchmarks/RESULTS.md) on dummy Qwen3-0.6B weights, median of --repeats runs.
- fp8: the same with --kv-cache-dtype fp8.
- latency: one request, 128 prompt + 512 output tokens, ms per output token, greedy and with Qwen3's sampling.
- hf: HF transformers' continuous batching on the same workload.
- streaming, streaming-fp8: 1,024 requests through 128 slots (prompts admitted beside running decodes), two runs.
- sampling: what vLLM's sampling features cost on the DESIGN workload, in one process: as is; penalties; logprobs=1
  and =5; 64 prompts x n=4 against the same 64 prompts sent 4 times each; top-k / top-p / min-p filters
  (`--sampling-rows` picks some: as-is,penalties,qwen3,topp,topk,minp,logprobs1,logprobs5,n4,copies).
- structured: the DESIGN workload with a regex, json_object or JSON schema constraint on its requests.
- profile1, profile256: torch.profiler tables of 20 decode steps at 1 and 256 running requests.
Each result is a `## name: value` row (benchmarks/ab.py reads them); a table of them is printed last.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import traceback
from pathlib import Path

import torch

from nvcli import LLM, SamplingParams
from nvcli.bench import latency, make_workload, run_workload, throughput
from nvcli.models.presets import preset_dir
from nvcli.testing.tiny_models import make_tiny_model

ROWS: list[tuple[str, str]] = []
FLOOR_TOKS = 25_500  # the DESIGN workload's floor on an H100: its KV and weight reads at copy bandwidth
NANO_VLLM = 13_216  # Nano-vLLM on the same workload and GPU
BATCHED_TOKENS = 16384  # tokens per step: Nano-vLLM's default, which the workload's figures assume


def row(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"## {name}: {value}", flush=True)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens equal before the first divergence, averaged over requests."""
    from nvcli.testing.kv_quality import greedy_agreement

    return greedy_agreement(a, b).prefix_frac


def free(llm: LLM | None) -> None:
    if llm is not None:
        llm.shutdown()
        llm.engine.executor = None  # drop the model and KV cache now, not at the next gc
    gc.collect()
    torch.cuda.empty_cache()


def correctness(tmp: Path) -> None:
    prompts = [list(range(1000 + 37 * i, 1000 + 37 * i + n)) for i, n in enumerate([5, 17, 33, 64, 100, 250])]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for arch in ("qwen3", "llama"):
        d = str(make_tiny_model(tmp / arch, arch))
        common = dict(max_model_len=512, max_num_batched_tokens=256)
        cpu = [o.outputs[0].token_ids for o in LLM(d, device="cpu", num_kvcache_blocks=256, **common).generate(prompts, sp)]
        for label, kw in [
            ("gpu fp32 eager", dict(dtype="float32", enforce_eager=True)),
            ("gpu fp32 graphs", dict(dtype="float32")),
            ("gpu bf16 graphs", dict(dtype="bfloat16")),
        ]:
            llm = LLM(d, device="cuda", num_kvcache_blocks=512, **common, **kw)
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            if label == "gpu bf16 graphs":
                ref_eager = LLM(d, device="cuda", num_kvcache_blocks=512, enforce_eager=True, dtype="bfloat16", **common)
                eager = [o.outputs[0].token_ids for o in ref_eager.generate(prompts, sp)]
                row(f"{arch} gpu bf16 graphs vs eager", f"agreement {agreement(out, eager):.3f}")
                free(ref_eager)
                del ref_eager
            exact = sum(x == y for x, y in zip(out, cpu))
            row(f"{arch} {label} vs CPU fp32", f"{exact}/{len(prompts)} identical, agreement {agreement(out, cpu):.3f}")
            if label == "gpu bf16 graphs":
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda()
                ref = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=48, min_new_tokens=48,
                                   do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
                row(f"{arch} gpu bf16 vs HF bf16 on GPU", f"agreement {agreement(out, ref):.3f}")
                del hf
            free(llm)
            del llm


def bench_throughput(model_dir: str, repeats: int, kv_cache_dtype: str = "auto", label: str = "bf16") -> None:
    t0 = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=BATCHED_TOKENS,
              kv_cache_dtype=kv_cache_dtype)
    row(f"start-up ({label}, dummy qwen3-0.6b, graphs captured)", f"{time.perf_counter() - t0:.1f} s, "
        f"{llm.stats().kv_blocks_total} KV blocks")
    work = make_workload(256, (100, 1024), (100, 1024), seed=0)
    s0 = llm.stats()
    res = throughput(llm.engine, work, repeats=repeats)
    s1 = llm.stats()
    tps = res["output_tokens_per_second"]
    row(f"host/device split ({label}, all runs)",
        f"steps {s1.num_steps - s0.num_steps} (decode-only {s1.num_decode_steps - s0.num_decode_steps}), "
        f"schedule {s1.schedule_s - s0.schedule_s:.2f} s, execute+sample {s1.execute_s - s0.execute_s:.2f} s, "
        f"postprocess {s1.postprocess_s - s0.postprocess_s:.2f} s")
    row(f"throughput {label} KV (median of {repeats})",
        f"{tps:,.0f} output tok/s, {res['elapsed_time']:.2f} s, runs {[round(t, 2) for t in res['all_elapsed_times']]}, "
        f"{tps / FLOOR_TOKS:.1%} of floor, {tps / NANO_VLLM:.2f}x Nano-vLLM; preemptions {llm.stats().num_preemptions}")
    free(llm)


def bench_streaming(model_dir: str, kv_cache_dtype: str = "auto", label: str = "bf16") -> None:
    """A long job in miniature: 1,024 requests through 128 slots, so most steps admit new prompts beside running
    decodes, each with a token count of its own. Run 1 meets the GEMMs' row counts for the first time; run 2
    (fresh prompts from the same distribution) is a long job's steady state."""
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=128, max_num_batched_tokens=BATCHED_TOKENS,
              kv_cache_dtype=kv_cache_dtype)
    run_workload(llm.engine, make_workload(1, (16, 16), (8, 8), seed=1))
    for run in (1, 2):
        work = make_workload(1024, (100, 1024), (100, 400), seed=run - 1)
        dt = run_workload(llm.engine, work)
        row(f"streaming {label} run {run} (1,024 requests, 128 slots, outputs 100-400)",
            f"{work.output_tokens / dt:,.0f} output tok/s, {dt:.2f} s")
    free(llm)


def bench_sampling_features(model_dir: str, repeats: int, only: str = "") -> None:
    import dataclasses
    import statistics

    from nvcli.bench import Workload

    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=BATCHED_TOKENS)
    base = make_workload(256, (100, 1024), (100, 1024), seed=0)
    penalized = Workload(base.prompts, [dataclasses.replace(sp, presence_penalty=0.2, frequency_penalty=0.2,
                                                            repetition_penalty=1.1) for sp in base.params])
    fan_out = Workload(base.prompts[:64], [dataclasses.replace(sp, n=4) for sp in base.params[:64]])
    copies = Workload([p for p in base.prompts[:64] for _ in range(4)], [sp for sp in base.params[:64] for _ in range(4)])
    run_workload(llm.engine, make_workload(1, (16, 16), (8, 8), seed=1))
    logprobs = {k: Workload(base.prompts, [dataclasses.replace(sp, logprobs=k) for sp in base.params]) for k in (1, 5)}
    filtered = {name: Workload(base.prompts, [dataclasses.replace(sp, **kw) for sp in base.params])
                for name, kw in [("qwen3", dict(top_k=20, top_p=0.95)), ("topp", dict(top_p=0.95)),
                                 ("topk", dict(top_k=50)), ("minp", dict(min_p=0.05))]}
    rows = {"as-is": ("as is", base), "penalties": ("penalties on every request", penalized),
            "qwen3": ("top_k 20, top_p 0.95 on every request (Qwen3's generation_config)", filtered["qwen3"]),
            "topp": ("top_p 0.95 on every request", filtered["topp"]),
            "topk": ("top_k 50 on every request", filtered["topk"]),
            "minp": ("min_p 0.05 on every request", filtered["minp"]),
            "logprobs1": ("logprobs=1 on every request", logprobs[1]),
            "logprobs5": ("logprobs=5 on every request", logprobs[5]),
            "n4": ("64 prompts x n=4", fan_out), "copies": ("64 prompts x 4 separate requests", copies)}
    for label, work in [rows[k] for k in (only.split(",") if only else rows)]:
        out_tokens = sum(sp.max_tokens * sp.n for sp in work.params)
        s0 = llm.stats()
        times = []
        for _ in range(repeats):
            llm.engine.reset_prefix_cache()
            times.append(run_workload(llm.engine, work))
        s1 = llm.stats()
        dt = statistics.median(times)
        row(f"sampling: {label}", f"{out_tokens / dt:,.0f} output tok/s, runs {[round(t, 2) for t in times]}, "
            f"prompt tokens computed per run {(s1.prompt_tokens - s0.prompt_tokens) // repeats:,}")
    free(llm)


def bench_structured_outputs(model_dir: str, repeats: int) -> None:
    """The DESIGN workload with a constraint on its requests: what the per-step masks cost (llguidance on the host,
    between the forward and the sampling; the upload and the mask kernel on the device). Constrained outputs may end
    early (an allowed EOS, a closed JSON object), so rates count the tokens generated."""
    import dataclasses

    from nvcli import StructuredOutputsParams
    from nvcli.bench import Workload

    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=BATCHED_TOKENS)
    base = make_workload(256, (100, 1024), (100, 1024), seed=0)
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["title", "year", "tags"]}

    def constrained(every: int, so: StructuredOutputsParams) -> Workload:
        return Workload(base.prompts, [dataclasses.replace(sp, structured_outputs=so) if i % every == 0 else sp
                                       for i, sp in enumerate(base.params)])

    run_workload(llm.engine, make_workload(1, (16, 16), (8, 8), seed=1))
    run_workload(llm.engine, constrained(1, StructuredOutputsParams(json_object=True)))  # the tokenizer's llguidance form
    for label, work in [("as is", base), ("regex [a-z ]+ on every request", constrained(1, StructuredOutputsParams(
                            regex="[a-z ]+"))),
                        ("json_object on every request", constrained(1, StructuredOutputsParams(json_object=True))),
                        ("a JSON schema on every other request", constrained(2, StructuredOutputsParams(json=schema)))]:
        times, tokens, steps = [], [], []
        compiler = llm.engine.grammar_compiler
        m0 = (compiler.mask_s, compiler.num_masked_steps, compiler.consume_s) if compiler else (0.0, 0, 0.0)
        h0 = llm.stats()
        for _ in range(repeats):
            llm.engine.reset_prefix_cache()
            s0 = llm.stats()
            times.append(run_workload(llm.engine, work))
            s1 = llm.stats()
            tokens.append(s1.generation_tokens - s0.generation_tokens)
            steps.append(s1.num_steps - s0.num_steps)
        m1 = (compiler.mask_s, compiler.num_masked_steps, compiler.consume_s) if compiler else (0.0, 0, 0.0)
        h1 = llm.stats()
        masked = m1[1] - m0[1]
        mask_ms = (f", host per masked step: mask fill {1e3 * (m1[0] - m0[0]) / masked:.2f} ms, tokens to matchers "
                   f"{1e3 * (m1[2] - m0[2]) / masked:.2f} ms" if masked else "")
        n = h1.num_steps - h0.num_steps
        mask_ms += (f"; host per step: schedule {1e3 * (h1.schedule_s - h0.schedule_s) / n:.2f} ms, launch+collect "
                    f"{1e3 * (h1.execute_s - h0.execute_s) / n:.2f} ms, postprocess "
                    f"{1e3 * (h1.postprocess_s - h0.postprocess_s) / n:.2f} ms")
        i = sorted(range(repeats), key=times.__getitem__)[repeats // 2]  # the median run
        row(f"structured outputs: {label}", f"{tokens[i] / times[i]:,.0f} output tok/s ({tokens[i]:,} tokens in "
            f"{times[i]:.2f} s, {steps[i]} steps), runs {[round(t, 2) for t in times]}{mask_ms}")
    free(llm)


def bench_latency(model_dir: str) -> None:
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512)
    res = latency(llm.engine, 128, 512, repeats=3)
    row("latency 128+512, one request", f"{res['ms_per_output_token']:.3f} ms/token, TTFT {res['ttft_ms']:.1f} ms, "
        f"total {res['avg_latency']:.2f} s")
    qwen3 = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)  # Qwen3's generation_config, nv's default for it
    res = latency(llm.engine, 128, 512, repeats=3, sampling=qwen3)
    row("latency 128+512, one request, Qwen3's sampling (temperature 0.6, top_k 20, top_p 0.95)",
        f"{res['ms_per_output_token']:.3f} ms/token, TTFT {res['ttft_ms']:.1f} ms, total {res['avg_latency']:.2f} s")
    free(llm)


def profile_steps(model_dir: str, batch: int) -> None:
    """Where a decode step's time goes: torch.profiler over 20 steps of `batch` running requests."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512)
    engine = llm.engine
    work = make_workload(batch, (500, 500), (400, 400), seed=0)
    for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
        engine.add_request(p, sp, request_id=f"prof-{i}")
    for _ in range(30):  # prefill and warm up
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 20
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    row(f"decode step, batch {batch} (profiled)", f"{dt * 1000:.2f} ms/step")
    while engine.has_unfinished():
        engine.step()
    free(llm)


def hf_continuous_batching(model, work, max_batch_tokens: int = 8192, num_blocks: int | None = None) -> tuple[int, float]:
    """The workload through HF transformers' continuous batching (paged SDPA), each request with its own
    max_new_tokens and EOS ignored: (output tokens, seconds from the first request to the last result; the
    manager's warm-up and CUDA-graph capture come before)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(sp.max_tokens for sp in work.params))
    cb = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, num_blocks=num_blocks)  # None: from free memory
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb) as manager:
        t0 = time.perf_counter()
        for i, (prompt, sp) in enumerate(zip(work.prompts, work.params)):
            manager.add_request(prompt, request_id=f"hf-{i}", max_new_tokens=sp.max_tokens)
        out_tokens = finished = 0
        while finished < len(work.prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                out_tokens += len(result.generated_tokens)
                finished += 1
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before the workload finished")
        return out_tokens, time.perf_counter() - t0


def bench_hf(model_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from nvcli.models.presets import PRESETS

    cfg_dict = dict(PRESETS["qwen3-0.6b"])
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="paged|sdpa").cuda()
    hf_continuous_batching(model, make_workload(8, (16, 32), (8, 16), seed=1))  # warm-up
    work = make_workload(256, (100, 1024), (100, 1024), seed=0)
    out_tokens, dt = hf_continuous_batching(model, work)
    row("HF transformers continuous batching (paged|sdpa, bf16)",
        f"{out_tokens:,} output tokens, {out_tokens / dt:,.0f} output tok/s ({dt:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="correctness,throughput,latency,fp8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sampling-rows", default="", help="the sampling section's rows, e.g. as-is,logprobs5")
    args = ap.parse_args()
    sections = args.sections.split(",")
    tmp = Path(tempfile.mkdtemp())
    model_dir = str(preset_dir("qwen3-0.6b", tmp))
    row("device", torch.cuda.get_device_name())
    for name, fn in [
        ("correctness", lambda: correctness(tmp)),
        ("throughput", lambda: bench_throughput(model_dir, args.repeats)),
        ("latency", lambda: bench_latency(model_dir)),
        ("fp8", lambda: bench_throughput(model_dir, args.repeats, "fp8", "fp8")),
        ("hf", lambda: bench_hf(model_dir)),
        ("streaming", lambda: bench_streaming(model_dir)),
        ("streaming-fp8", lambda: bench_streaming(model_dir, "fp8", "fp8")),
        ("sampling", lambda: bench_sampling_features(model_dir, args.repeats, args.sampling_rows)),
        ("structured", lambda: bench_structured_outputs(model_dir, args.repeats)),
        ("profile1", lambda: profile_steps(model_dir, 1)),
        ("profile256", lambda: profile_steps(model_dir, 256)),
    ]:
        if name not in sections:
            continue
        try:
            fn()
        except Exception:
            traceback.print_exc()
            row(name, "FAILED (traceback above)")
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| what | result |\n| --- | --- |")
    for k, v in ROWS:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
