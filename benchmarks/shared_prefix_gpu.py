"""What a shared prompt prefix costs decode: attention over pages many sequences share, against the same lengths
unshared.

    PYTHONPATH=. python3 benchmarks/shared_prefix_gpu.py [--sections kernel,e2e,stream,job] [--kv-cache-dtype fp8]
        [--instructions N]

Batch jobs often repeat one long instruction in front of every line. Prefix caching computes it once, and every
sequence's block table then starts with the same physical pages. The engine's shared-prefix decode kernel
(kernels/shared_prefix_attention.py) reads those pages once per group of 16 query rows instead of once per sequence
and KV head.

- kernel: the engine's decode attention (longest first) at B sequences of P shared + S own tokens, against B
  sequences of P + S tokens each on pages of their own, and the shared-prefix kernel on the shared pages; us per
  call, median of do_bench.
- e2e: dummy Qwen3-0.6B, 512 requests of a 1,024-token shared prefix + 64 own tokens, 256 output tokens each,
  against 512 prompts of 1,088 own tokens; output tok/s, and the median wall time of the decode-only steps. The
  warm-up job (300 shared-prefix requests) captures the shared-prefix graphs of the batch sizes the runs meet.
- stream: a long job's steady state. 1,024 lines of the same 1,024-token prefix + 64 own tokens through 256 slots,
  output lengths randint(64, 448): lines finish at different steps and new ones join beside running decodes, so most
  steps carry prompt chunks (mixed graphs). Against the same job with 1,088 own tokens per line.
- job: the stream job as JSONL lines of token ids through `run_job` (nv generate's reader thread, ordered writer).

--kv-cache-dtype fp8: every section over an fp8 cache (32-token pages, V dims-major once a page is full).
--instructions N: the stream and job lines cycle through N different instructions (each group of rows that the
kernel forms then reads its own instruction's pages).
Results are table rows `| section | case | value | ... |`; benchmarks/ab.py reads the last table.
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
from nvcli.kernels.kv_layout import PagedKV, page_view
from nvcli.kernels.shared_prefix_attention import shared_prefix_decode_attention_triton

if TYPE_CHECKING:
    from nvcli import LLM
    from nvcli.engine.llm_engine import EngineStats

PAGE = 16  # 32 with --kv-cache-dtype fp8
KV_DTYPE = "auto"
INSTRUCTIONS = 1  # stream / job: lines cycle through this many different instructions


def kv_cache(num_blocks: int) -> PagedKV:
    """A random KV cache of 8 KV heads of 128 dims, as the engine lays it out: bf16, or fp8 with V dims-major (open
    pages then read token-major: the values differ, the bytes read do not) and [1] device scales."""
    shape = (num_blocks, PAGE, 8, 128)
    if KV_DTYPE != "fp8":
        k = torch.randn(shape, device="cuda").to(torch.bfloat16)
        return PagedKV(k, torch.randn_like(k))
    k = torch.randn(shape, device="cuda").to(torch.float8_e4m3fn)
    v = page_view(torch.randn(num_blocks, PAGE * 8 * 128, device="cuda").to(torch.float8_e4m3fn), PAGE, 8, 128, True)
    return PagedKV(k, v, torch.ones(1, device="cuda"), torch.ones(1, device="cuda"))


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
            kv = kv_cache(num_blocks)
            q = torch.randn(batch, 16, 128, device="cuda").to(torch.bfloat16)
            order = torch.argsort(lens, descending=True).to(torch.int32).cuda()
            tt, ll = t.cuda(), lens.cuda()
            ms = triton.testing.do_bench(
                lambda q=q, kv=kv, tt=tt, ll=ll, order=order: paged_decode_attention_triton(
                    q, kv, tt, ll, 128 ** -0.5, order=order), warmup=50, rep=300)
            gb = float(lens.sum()) * 8 * 128 * 2 * kv.k.element_size() / 1e9
            res[share] = ms
            out.append(f"| kernel | {batch} x ({shared} {'shared' if share else 'own'} + 1-{own} own) | "
                       f"{ms * 1e3:.1f} us | {gb / ms:.2f} TB/s of logical KV |")
            if share:
                ref = paged_decode_attention_triton(q, kv, tt, ll, 128 ** -0.5, order=order)
                n_shared = torch.tensor([shared], dtype=torch.int32, device="cuda")
                got = shared_prefix_decode_attention_triton(q, kv, tt, ll, n_shared, 128 ** -0.5, order)
                err = (got.float() - ref.float()).abs().max().item()
                ms_sp = triton.testing.do_bench(
                    lambda q=q, kv=kv, tt=tt, ll=ll, order=order, n=n_shared: (
                        shared_prefix_decode_attention_triton(q, kv, tt, ll, n, 128 ** -0.5, order)),
                    warmup=50, rep=300)
                res["kernel"] = ms_sp
                out.append(f"| kernel | same, shared-prefix kernel (max diff {err:.1e}) | {ms_sp * 1e3:.1f} us | "
                           f"{gb / ms_sp:.2f} TB/s of logical KV |")
            del kv
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


def stream_job(lines: int, seed: int, shared: bool = True) -> tuple[list[list[int]], list]:
    """`lines` prompts of a 1,024-token instruction (one of INSTRUCTIONS, in turn) + 64 own tokens, output lengths
    randint(64, 448); with `shared` False, 1,088 own tokens each and the same output lengths."""
    from nvcli import SamplingParams

    rng = random.Random(seed)
    prefixes = [[rng.randint(0, 10000) for _ in range(1024)] for _ in range(INSTRUCTIONS)]
    prompts = [prefixes[i % INSTRUCTIONS] + [rng.randint(0, 10000) for _ in range(64)] for i in range(lines)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(64, 448)) for _ in prompts]
    if not shared:
        prompts = [[rng.randint(0, 10000) for _ in range(1088)] for _ in prompts]
    return prompts, params


def host_split(s0: EngineStats, s1: EngineStats) -> str:
    """Where the engine thread's time went between two EngineStats snapshots."""
    return (f"host: schedule {s1.schedule_s - s0.schedule_s:.2f} s, wait+sample {s1.execute_s - s0.execute_s:.2f} s, "
            f"postprocess {s1.postprocess_s - s0.postprocess_s:.2f} s")


def timed_job(llm: LLM, name: str, prompts: list[list[int]], params: list) -> tuple[float, list[float]]:
    """One job from an empty prefix cache: (wall seconds, wall seconds of each decode-only step)."""
    engine = llm.engine
    engine.reset_prefix_cache()
    steps: list[float] = []
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=f"{name}-{time.monotonic_ns()}-{i}")
    last, decodes = time.perf_counter(), llm.stats().num_decode_steps
    while engine.has_unfinished():
        engine.step()
        now, dec = time.perf_counter(), llm.stats().num_decode_steps
        if dec > decodes:
            steps.append(now - last)
        last, decodes = now, dec
    return time.perf_counter() - t0, sorted(steps)


def run_variants(section: str, llm: LLM, jobs: dict[str, tuple[list[list[int]], list]], order: list[str]
                 ) -> list[str]:
    """The jobs in `order` (each name a key of `jobs`; the first is a warm-up), one table row per timed run."""
    out = []
    for n, name in enumerate(order):
        prompts, params = jobs[name]
        s0 = llm.stats()
        dt, steps = timed_job(llm, name, prompts, params)
        if n == 0:
            continue
        s1 = llm.stats()
        output_tokens = sum(sp.max_tokens for sp in params)
        line = (f"| {section} | {name} | {output_tokens / dt:,.0f} output tok/s ({dt:.2f} s) | decode-only steps "
                f"{len(steps)}, median {steps[len(steps) // 2] * 1e3:.2f} ms; prefix-cache hits "
                f"{s1.prefix_cache_hit_tokens - s0.prefix_cache_hit_tokens:,} tokens; {host_split(s0, s1)} |")
        print(line, flush=True)
        out.append(line)
    return out


def e2e_section() -> list[str]:
    from nvcli import SamplingParams

    rng = random.Random(0)
    prefix = [rng.randint(0, 10000) for _ in range(1024)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=256) for _ in range(512)]
    shared = [prefix + [rng.randint(0, 10000) for _ in range(64)] for _ in range(512)]
    unique = [[rng.randint(0, 10000) for _ in range(1088)] for _ in range(512)]
    on, own = "shared 1,024-token prefix, shared-prefix graphs", "own prompts"
    jobs = {"warm-up": (shared[:300], params[:300]), on: (shared, params), own: (unique, params)}
    llm = dummy_llm()
    try:
        return run_variants("e2e", llm, jobs, ["warm-up", own, on, on, own])
    finally:
        llm.shutdown()


def stream_section() -> list[str]:
    on, own = "shared-prefix kernel: decode and mixed steps", "own prompts of the same length"
    jobs = {on: stream_job(1024, seed=1), own: stream_job(1024, seed=1, shared=False)}
    jobs["warm-up"] = jobs[on]
    llm = dummy_llm()
    try:
        return run_variants("stream", llm, jobs, ["warm-up", on, own, on])
    finally:
        llm.shutdown()


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
        s0 = llm.stats()
        res = run_job(engine, lines, io.BytesIO(), JobOptions(defaults=Defaults(), handle_sigint=False))
        s1 = llm.stats()
        assert res.written == len(lines) and res.failed == 0, (res.written, res.failed)
        if run == "warm-up":
            continue
        out.append(f"| job | run {run} | {output_tokens / res.elapsed_s:,.0f} output tok/s ({res.elapsed_s:.2f} s) | "
                   f"{host_split(s0, s1)} |")
        print(out[-1], flush=True)
    llm.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="kernel,e2e,stream")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--instructions", type=int, default=1)
    args = ap.parse_args()
    global PAGE, KV_DTYPE, INSTRUCTIONS
    KV_DTYPE = args.kv_cache_dtype
    INSTRUCTIONS = args.instructions
    PAGE = 32 if KV_DTYPE == "fp8" else 16
    sections = args.sections.split(",")
    rows = []
    for name, fn in (("kernel", kernel_section), ("e2e", e2e_section), ("stream", stream_section),
                     ("job", job_section)):
        if name in sections:
            rows += fn()
    print("\n| what | case | time | |\n| --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
