"""What a shared prompt prefix costs decode: attention over pages many sequences share, against the same lengths
unshared.

    PYTHONPATH=. python3 benchmarks/shared_prefix_gpu.py [--sections kernel,e2e,stream] [--kv-cache-dtype fp8]

Batch jobs often repeat one long instruction in front of every line. Prefix caching computes it once, and every
sequence's block table then starts with the same physical pages. Decode attention still reads those pages once per
sequence and KV head. If the sequences that share them run close together, the reads may come from L2 (a layer's
1,024-token prefix is 4 MB of bf16 KV), and a dedicated shared-prefix pass (vLLM's cascade attention) would gain
little; if not, it would cut a step's KV reads by up to the shared fraction. This measures which.

- kernel: the engine's decode attention (bf16, 16-token pages, longest first) at B sequences of P shared + S own
  tokens, against B sequences of P + S tokens each on pages of their own; us per call, median of do_bench.
- e2e: dummy Qwen3-0.6B, 512 requests of a 1,024-token shared prefix + 64 own tokens, 256 output tokens each, with
  the shared-prefix decode graphs (kernels/shared_prefix_attention.py) and with the ordinary ones, against 512
  prompts of 1,088 own tokens; output tok/s, and the median wall time of the decode-only steps. The warm-up job
  (300 shared-prefix requests) captures the shared-prefix graphs of the batch sizes the runs meet.
- stream: a long job's steady state. 1,024 lines of the same 1,024-token prefix + 64 own tokens through 256 slots,
  output lengths randint(64, 448): lines finish at different steps and new ones join beside running decodes, so most
  steps carry prompt chunks (mixed graphs). With the shared-prefix kernel in decode and mixed steps, in decode steps
  only, and not at all; output tok/s of each run, variants in turn, twice. --min-rows 17,32: the kernel on, with the
  plan's row threshold at each value instead.
- timeline: the stream job with the kernel on, three runs, every step timed with CUDA events: GPU time and GPU idle
  between steps (what the host did not hide). PROFILE_CPROFILE_STEPS=N profiles the host over run 2's first N steps.
- profile: kernels per step in the stream job's steady state, with the kernel and without.
- job: the stream job as JSONL lines of token ids through `run_job` (nv generate's reader thread, ordered writer).

--kv-cache-dtype fp8: every section over an fp8 cache (32-token pages, V dims-major once a page is full).
--instructions N: the stream and profile jobs' lines cycle through N different instructions (each group of rows that
the kernel forms then reads its own instruction's pages).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import triton.testing

from nvcli.kernels.decode_attention import paged_decode_attention_triton
from nvcli.kernels.shared_prefix_attention import shared_prefix_decode_attention_triton

if TYPE_CHECKING:
    from nvcli import LLM
    from nvcli.engine.llm_engine import EngineStats

PAGE = 16  # 32 with --kv-cache-dtype fp8
KV_DTYPE = "auto"
INSTRUCTIONS = 1  # stream / profile: lines cycle through this many different instructions
MIN_ROWS: list[int] = []  # stream: instead of the on / off variants, the kernel on at each of these row thresholds


def kv_cache(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Random K and V caches of 8 KV heads of 128 dims, as the engine lays them out, and the attention kernels'
    scale arguments: bf16, or fp8 with V dims-major (open pages then read token-major: the values differ, the
    bytes read do not)."""
    shape = (num_blocks, PAGE, 8, 128)
    if KV_DTYPE != "fp8":
        k = torch.randn(shape, device="cuda").to(torch.bfloat16)
        return k, torch.randn_like(k), {}
    from nvcli.kernels.kv_layout import page_view

    k = torch.randn(shape, device="cuda").to(torch.float8_e4m3fn)
    v = page_view(torch.randn(num_blocks, PAGE * 8 * 128, device="cuda").to(torch.float8_e4m3fn), PAGE, 8, 128, True)
    one = torch.ones(1, device="cuda")
    return k, v, {"k_scale": one, "v_scale": one}


def tables(batch: int, shared: int, own: int, share: bool, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables [batch, pages] (shuffled blocks): the first shared // PAGE pages the same for every row if
    `share`, and the number of blocks they use."""
    p_pages, o_pages = shared // PAGE, -(-own // PAGE)
    rows = p_pages + o_pages
    num_blocks = (p_pages if share else batch * p_pages) + batch * o_pages + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    t = torch.empty(batch, rows, dtype=torch.int32)
    i = 0
    if share:
        t[:, :p_pages] = perm[:p_pages]
        i = p_pages
    for b in range(batch):
        if not share:
            t[b, :p_pages] = perm[i:i + p_pages]
            i += p_pages
        t[b, p_pages:] = perm[i:i + o_pages]
        i += o_pages
    return t, num_blocks


def kernel_section() -> list[str]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for batch, shared, own in ((256, 1024, 64), (256, 2048, 128), (128, 1024, 64), (64, 3072, 128), (256, 1024, 512),
                               (128, 1024, 512)):
        rng = random.Random(batch + shared)
        res = {}
        for share in (False, True):
            t, num_blocks = tables(batch, shared, own, share, gen)
            lens = torch.tensor([shared + rng.randint(1, own) for _ in range(batch)], dtype=torch.int32)
            k, v, scales = kv_cache(num_blocks)
            q = torch.randn(batch, 16, 128, device="cuda").to(torch.bfloat16)
            order = torch.argsort(lens, descending=True).to(torch.int32).cuda()
            tt, ll = t.cuda(), lens.cuda()
            ms = triton.testing.do_bench(
                lambda q=q, k=k, v=v, tt=tt, ll=ll, order=order, scales=scales: paged_decode_attention_triton(
                    q, k, v, tt, ll, 128 ** -0.5, order=order, **scales), warmup=50, rep=300)
            gb = float(lens.sum()) * 8 * 128 * 2 * k.element_size() / 1e9
            res[share] = ms
            out.append(f"| kernel | {batch} x ({shared} {'shared' if share else 'own'} + 1-{own} own) | "
                       f"{ms * 1e3:.1f} us | {gb / ms:.2f} TB/s of logical KV |")
            if share:
                ref = paged_decode_attention_triton(q, k, v, tt, ll, 128 ** -0.5, order=order, **scales)
                n_shared = torch.tensor([shared], dtype=torch.int32, device="cuda")
                got = shared_prefix_decode_attention_triton(q, k, v, tt, ll, n_shared, 128 ** -0.5, order, **scales)
                err = (got.float() - ref.float()).abs().max().item()
                ms_sp = triton.testing.do_bench(
                    lambda q=q, k=k, v=v, tt=tt, ll=ll, order=order, n=n_shared, scales=scales: (
                        shared_prefix_decode_attention_triton(q, k, v, tt, ll, n, 128 ** -0.5, order, **scales)),
                    warmup=50, rep=300)
                res["kernel"] = ms_sp
                out.append(f"| kernel | same, shared-prefix kernel (max diff {err:.1e}) | {ms_sp * 1e3:.1f} us | "
                           f"{gb / ms_sp:.2f} TB/s of logical KV |")
            del k, v
        out.append(f"| kernel | shared / own: engine kernel {res[True] / res[False]:.2f}, shared-prefix kernel "
                   f"{res['kernel'] / res[False]:.2f} | | |")
        print("\n".join(out[-4:]), flush=True)
    return out


def dummy_llm() -> LLM:
    """Dummy Qwen3-0.6B weights, 256 slots, 16,384-token steps, the chosen KV cache dtype."""
    from nvcli import LLM
    from nvcli.models.presets import preset_dir

    return LLM(str(preset_dir("qwen3-0.6b", Path(tempfile.mkdtemp()))), load_format="dummy", max_model_len=4096,
               max_num_seqs=256, max_num_batched_tokens=16384, kv_cache_dtype=KV_DTYPE)


def stream_job(lines: int, seed: int) -> tuple[list[list[int]], list]:
    """`lines` prompts of a 1,024-token instruction (one of INSTRUCTIONS, in turn) + 64 own tokens, output lengths
    randint(64, 448)."""
    from nvcli import SamplingParams

    rng = random.Random(seed)
    prefixes = [[rng.randint(0, 10000) for _ in range(1024)] for _ in range(INSTRUCTIONS)]
    prompts = [prefixes[i % INSTRUCTIONS] + [rng.randint(0, 10000) for _ in range(64)] for i in range(lines)]
    return prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(64, 448)) for _ in prompts]


def e2e_section() -> list[str]:
    from nvcli import SamplingParams
    from nvcli.bench import Workload

    llm = dummy_llm()
    engine = llm.engine
    runner = engine.executor.runner
    shared_ok = runner.shared_prefix_ok
    rng = random.Random(0)
    prefix = [rng.randint(0, 10000) for _ in range(1024)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=256) for _ in range(512)]
    shared = Workload([prefix + [rng.randint(0, 10000) for _ in range(64)] for _ in range(512)], params)
    unique = Workload([[rng.randint(0, 10000) for _ in range(1088)] for _ in range(512)], params)
    out = []
    on, off = "shared 1,024-token prefix, shared-prefix graphs", "shared 1,024-token prefix, ordinary graphs"
    for name, work in (("warm-up", Workload(shared.prompts[:300], params[:300])), ("own prompts", unique), (on, shared),
                       (off, shared), ("own prompts", unique), (off, shared), (on, shared)):
        engine.reset_prefix_cache()
        runner.shared_prefix_ok = shared_ok and name != off
        steps: list[float] = []  # wall seconds of each decode-only step
        s0 = llm.stats()
        t0 = time.perf_counter()
        for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
            engine.add_request(p, sp, request_id=f"{name}-{time.monotonic_ns()}-{i}")
        last, decodes = time.perf_counter(), llm.stats().num_decode_steps
        while engine.has_unfinished():
            engine.step()
            now, dec = time.perf_counter(), llm.stats().num_decode_steps
            if dec > decodes:
                steps.append(now - last)
            last, decodes = now, dec
        dt = time.perf_counter() - t0
        if name == "warm-up":
            continue
        steps.sort()
        s1 = llm.stats()
        line = (f"| e2e | {name} | {work.output_tokens / dt:,.0f} output tok/s ({dt:.2f} s) | decode-only steps: "
                f"{len(steps)}, median {steps[len(steps) // 2] * 1e3:.2f} ms; host: schedule "
                f"{s1.schedule_s - s0.schedule_s:.2f} s, postprocess {s1.postprocess_s - s0.postprocess_s:.2f} s |")
        print(line, flush=True)
        out.append(line)
    out.append(f"| e2e | shared-prefix graphs captured | {sorted(runner.shared_graphs)} | |")
    return out


def stream_section() -> list[str]:
    from nvcli.engine import model_runner

    llm = dummy_llm()
    engine = llm.engine
    runner = engine.executor.runner
    shared_ok = runner.shared_prefix_ok
    prompts, params = stream_job(1024, seed=1)
    output_tokens = sum(p.max_tokens for p in params)
    found = {"decode": 0, "mixed": 0}  # steps whose rows shared their first pages, by kind
    plan_of = model_runner.shared_prefix_plan
    replay_mixed = runner._replay_mixed_graph
    mode = {"mixed": True, "counting": "decode"}

    def counting(tables, lens, block_size, seqs):  # noqa: ANN001, ANN202
        plan = plan_of(tables, lens, block_size, seqs)
        found[mode["counting"]] += plan is not None
        return plan

    def mixed(step, key):  # noqa: ANN001, ANN202
        ok, mode["counting"] = runner.shared_prefix_ok, "mixed"
        runner.shared_prefix_ok = ok and mode["mixed"]
        try:
            return replay_mixed(step, key)
        finally:
            runner.shared_prefix_ok, mode["counting"] = ok, "decode"

    model_runner.shared_prefix_plan = counting
    runner._replay_mixed_graph = mixed
    out = []
    variants = {"decode and mixed steps": (True, True), "decode steps only": (True, False), "off": (False, False)}
    if MIN_ROWS:  # the plan declines steps of fewer rows than SHARED_PREFIX_MIN_ROWS: the tail of a job
        variants = {f"from {n} rows": (True, True) for n in MIN_ROWS}
    min_rows = model_runner.SHARED_PREFIX_MIN_ROWS
    for name in ["warm-up", *variants, *reversed(variants)]:
        engine.reset_prefix_cache()
        on, mode["mixed"] = variants.get(name, (True, True))
        runner.shared_prefix_ok = shared_ok and on
        model_runner.SHARED_PREFIX_MIN_ROWS = int(name.split()[1]) if name.startswith("from ") else min_rows
        found.update(decode=0, mixed=0)
        mixed0, s0 = runner.num_mixed_replays, llm.stats()
        t0 = time.perf_counter()
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=f"{name}-{time.monotonic_ns()}-{i}")
        while engine.has_unfinished():
            engine.step()
        dt = time.perf_counter() - t0
        if name == "warm-up":
            continue
        s1 = llm.stats()
        line = (f"| stream | shared-prefix kernel: {name} | {output_tokens / dt:,.0f} output tok/s ({dt:.2f} s) | "
                f"decode-only steps {s1.num_decode_steps - s0.num_decode_steps} ({found['decode']} shared), mixed "
                f"graph steps {runner.num_mixed_replays - mixed0} ({found['mixed']} shared); host: schedule "
                f"{s1.schedule_s - s0.schedule_s:.2f} s, postprocess {s1.postprocess_s - s0.postprocess_s:.2f} s |")
        print(line, flush=True)
        out.append(line)
    out.append(f"| stream | shared-prefix graphs captured | decode {sorted(runner.shared_graphs)}, mixed "
               f"{sorted(runner.shared_mixed_graphs)} | |")
    return out


def host_split(s0: EngineStats, s1: EngineStats) -> str:
    """Where the engine thread's time went between two EngineStats snapshots."""
    return (f"host: schedule {s1.schedule_s - s0.schedule_s:.2f} s, wait+sample {s1.execute_s - s0.execute_s:.2f} s, "
            f"postprocess {s1.postprocess_s - s0.postprocess_s:.2f} s")


def timeline_section() -> list[str]:
    """The stream job with the kernel on, each launched step timed with CUDA events (profile_gpu._timed_run): how
    long the GPU worked and how long it sat idle between steps, i.e. whether the host keeps up with steps this short.
    PROFILE_CPROFILE_STEPS=N adds a host profile of the first N steps of the second run."""
    import os
    import types

    from profile_gpu import _timed_run

    llm = dummy_llm()
    engine = llm.engine
    prompts, params = stream_job(1024, seed=1)
    work = types.SimpleNamespace(prompts=prompts, params=params)
    output_tokens = sum(p.max_tokens for p in params)
    cprofile = os.environ.pop("PROFILE_CPROFILE_STEPS", "0")
    out = []
    for run in ("warm-up", "1", "2", "3"):
        engine.reset_prefix_cache()
        if run == "2":
            os.environ["PROFILE_CPROFILE_STEPS"] = cprofile
        s0 = llm.stats()
        total, records = _timed_run(engine, work, f"{run}-{time.monotonic_ns()}")
        os.environ.pop("PROFILE_CPROFILE_STEPS", None)
        s1 = llm.stats()
        if run == "warm-up":
            continue
        busy, idle = sum(r[0] for r in records), sum(r[1] for r in records)
        long_idle = sorted((r[1] for r in records), reverse=True)
        out.append(f"| timeline | run {run}{' (host profiled)' if run == '2' and cprofile != '0' else ''} | "
                   f"{output_tokens / total:,.0f} output tok/s ({total:.2f} s) | {len(records)} steps: GPU "
                   f"{busy:.2f} s, idle between steps {idle:.2f} s (longest {1e3 * long_idle[0]:.1f}, "
                   f"{1e3 * long_idle[9]:.1f} ms the 10th); {host_split(s0, s1)} |")
        print(out[-1], flush=True)
    llm.shutdown()
    return out


def job_section() -> list[str]:
    """The stream job's lines as JSONL token ids (each with its own max_tokens) through `run_job`, as `nv generate`
    runs them: a reader thread, ordered output, the engine on the main thread sharing the GIL with the reader."""
    import io
    import json

    from nvcli.jobs.requests import Defaults
    from nvcli.jobs.runner import JobOptions, run_job

    llm = dummy_llm()
    engine = llm.engine
    prompts, params = stream_job(1024, seed=1)
    lines = [(json.dumps({"prompt_token_ids": p, "max_tokens": sp.max_tokens, "temperature": 0.6, "ignore_eos": True})
              + "\n").encode() for p, sp in zip(prompts, params)]
    output_tokens = sum(p.max_tokens for p in params)
    out = []
    for run in ("warm-up", "1", "2", "3"):
        engine.reset_prefix_cache()
        sink = io.BytesIO()
        s0 = llm.stats()
        res = run_job(engine, lines, sink, JobOptions(defaults=Defaults(), handle_sigint=False))
        s1 = llm.stats()
        assert res.written == len(lines) and res.failed == 0, (res.written, res.failed)
        if run == "warm-up":
            continue
        out.append(f"| job | run {run} | {output_tokens / res.elapsed_s:,.0f} output tok/s ({res.elapsed_s:.2f} s) | "
                   f"{host_split(s0, s1)} |")
        print(out[-1], flush=True)
    llm.shutdown()
    return out


def profile_section() -> list[str]:
    """Kernels of 30 steady-state steps of the stream job (600 lines), with the shared-prefix kernel and without."""
    from profile_gpu import kernel_table
    from torch.profiler import ProfilerActivity, profile

    llm = dummy_llm()
    engine, runner = llm.engine, llm.engine.executor.runner
    shared_ok = runner.shared_prefix_ok
    prompts, params = stream_job(600, seed=2)
    out = []
    for name in ("warm-up", "on", "off", "on"):
        engine.reset_prefix_cache()
        runner.shared_prefix_ok = shared_ok and name != "off"
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=f"prof-{name}-{time.monotonic_ns()}-{i}")
        for _ in range(200):
            engine.step()
        torch.cuda.synchronize()
        if name != "warm-up":
            n = 30
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    engine.step()
                torch.cuda.synchronize()
            count, busy, rows = kernel_table(prof, n)
            out.append(f"| profile | shared-prefix kernel {name}: GPU busy {busy:.0f} us/step, {count} kernels/step | "
                       + "; ".join(f"{k} {calls:.0f}x {us:.0f} us" for k, calls, us in rows[:9]) + " | |")
            print(out[-1], flush=True)
        while engine.has_unfinished():
            engine.step()
    llm.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="kernel,e2e,stream")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--instructions", type=int, default=1)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval before the sections (Python's default: 0.005 s)")
    ap.add_argument("--min-rows", default="", help="stream: comma-separated row thresholds to compare, e.g. 17,32")
    args = ap.parse_args()
    global PAGE, KV_DTYPE, INSTRUCTIONS, MIN_ROWS
    KV_DTYPE = args.kv_cache_dtype
    INSTRUCTIONS = args.instructions
    MIN_ROWS = [int(n) for n in args.min_rows.split(",") if n]
    if args.switch_interval is not None:  # how long a thread that wants the GIL waits for the one holding it
        sys.setswitchinterval(args.switch_interval)
    PAGE = 32 if KV_DTYPE == "fp8" else 16
    rows = []
    if "kernel" in args.sections:
        rows += kernel_section()
    if "e2e" in args.sections:
        rows += e2e_section()
    if "stream" in args.sections:
        rows += stream_section()
    if "profile" in args.sections:
        rows += profile_section()
    if "timeline" in args.sections:
        rows += timeline_section()
    if "job" in args.sections:
        rows += job_section()
    print("\n| what | case | time | |\n| --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
