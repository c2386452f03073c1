"""Where the time goes on one GPU: decode-step kernel breakdowns, a per-step timeline of the
benchmark workload, and decode-attention config sweeps (bf16 and fp8 caches).

    PYTHONPATH=. python3 benchmarks/profile_gpu.py [--sections steps,timeline,sweep] [--kv-cache-dtype fp8]

steps: torch.profiler over 10 decode steps (CUDA graphs) at batch 1/32/128/256 with ~600-token
  contexts: per-step kernel count, GPU busy time (sum of kernel durations), wall time, and the
  kernels that take the most time per step.
timeline: the DESIGN.md workload once after a warm-up, each engine step timed; time grouped by
  the launched batch's size (prefill-carrying steps apart), so the cost of the shrinking tail
  and of prefill is visible next to the big-batch decode steps.
sweep: the decode-attention kernel at B=256 / B=64 with 1000-token contexts and at B=256 with
  lengths spread over 100-2000 (the workload's mix), over block_n/warps/stages(/fp16 dots), bf16 and fp8.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from nvcli import LLM
from nvcli.bench import make_workload, run_workload
from nvcli.models.presets import preset_dir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def short(name: str) -> str:
    for key, label in [("_decode_split", "decode_attn"), ("_decode_reduce", "decode_reduce"),
                       ("_skinny_gemm", "skinny_gemm"), ("_splitk_reduce", "splitk_reduce"),
                       ("rms_norm", "add_rms_norm"), ("rope", "rope_qk_norm"), ("_store_kv", "kv_store"),
                       ("silu", "silu_mul"), ("_sample_chunk", "sampler_chunks"), ("gemm", "cublas_gemm"),
                       ("nvjet", "cublas_gemm"), ("sm90_xmma", "cublas_gemm"), ("Memcpy", "memcpy"),
                       ("memcpy", "memcpy")]:
        if key in name:
            return label
    return name[:40]


def kernel_table(prof, steps: int) -> tuple[int, float, list[tuple[str, float, float]]]:
    """(kernels per step, GPU-busy us per step, [(kernel, calls/step, us/step)])."""
    per: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[short(e.name)].append(e.time_range.elapsed_us())
    rows = sorted(((k, len(v) / steps, sum(v) / steps) for k, v in per.items()), key=lambda r: -r[2])
    count = sum(len(v) for v in per.values()) / steps
    busy = sum(r[2] for r in rows)
    return int(count), busy, rows


def steps_section(model_dir: str, batches: list[int], kv_cache_dtype: str) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    out = []
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=16384,
              kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    for batch in batches:
        work = make_workload(batch, (600, 600), (200, 200), seed=0)
        for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
            engine.add_request(p, sp, request_id=f"prof-{batch}-{i}")
        for _ in range(40):  # prefill, then decode steps only
            engine.step()
        torch.cuda.synchronize()
        n = 10
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n * 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                engine.step()
            torch.cuda.synchronize()
        count, busy, rows = kernel_table(prof, n)
        line = (f"batch {batch} ({kv_cache_dtype}): wall {wall:.0f} us/step (unprofiled), GPU busy {busy:.0f} us/step, "
                f"{count} kernels/step")
        print(line)
        for name, calls, us in rows[:14]:
            print(f"    {name:40s} {calls:6.1f} calls {us:8.1f} us  {us / calls if calls else 0:6.2f} us/call")
        out.append(line)
        while engine.has_unfinished():
            engine.step()
    llm.shutdown()
    return out


def _timed_run(engine, work, tag: str) -> tuple[float, list[tuple[float, int, bool]]]:
    records: list[tuple[float, int, bool]] = []  # (step seconds, launched batch size, decode-only)
    for i, (p, sp) in enumerate(zip(work.prompts, work.params)):
        engine.add_request(p, sp, request_id=f"tl-{tag}-{i}")
    t_start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        h = engine._in_flight
        bs, dec = (len(h.batch.seqs), h.batch.is_decode_only) if h is not None else (0, True)
        records.append((time.perf_counter() - t0, bs, dec))
    return time.perf_counter() - t_start, records


def timeline_section(model_dir: str, kv_cache_dtype: str) -> list[str]:
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=16384,
              kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    run_workload(engine, make_workload(1, (16, 16), (8, 8), seed=1))
    work = make_workload(256, (100, 1024), (100, 1024), seed=0)
    out = []
    for run in (1, 2):
        s0 = engine.stats()
        total, records = _timed_run(engine, work, str(run))
        s1 = engine.stats()
        buckets = [(0, 0), (1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 512)]
        out.append(f"timeline ({kv_cache_dtype}, run {run}): {total:.2f} s, {len(records)} steps, "
                   f"{work.output_tokens / total:,.0f} output tok/s; host: schedule {s1.schedule_s - s0.schedule_s:.2f} s, "
                   f"wait+sample {s1.execute_s - s0.execute_s:.2f} s, postprocess {s1.postprocess_s - s0.postprocess_s:.2f} s")
        pre = [r for r in records if not r[2]]
        out.append(f"  steps carrying prefill: {len(pre)}, {sum(r[0] for r in pre):.3f} s")
        for lo, hi in buckets:
            rs = [r for r in records if r[2] and lo <= r[1] <= hi]
            if rs:
                s = sum(r[0] for r in rs)
                out.append(f"  decode batch {lo:3d}-{hi:3d}: {len(rs):5d} steps, {s:6.3f} s ({s / total:5.1%}), "
                           f"{1000 * s / len(rs):6.3f} ms/step, {sum(r[1] for r in rs):7d} tokens")
        slow = sorted(records, key=lambda r: -r[0])[:12]
        out.append("  slowest steps (ms, batch, decode-only): "
                   + ", ".join(f"{1000 * r[0]:.1f}/{r[1]}/{int(r[2])}" for r in slow))
        out.append("  last 40 steps (ms/batch): " + " ".join(f"{1000 * r[0]:.1f}/{r[1]}" for r in records[-40:]))
    print("\n".join(out))
    llm.shutdown()
    return out


def _time_decode(kb, q, kc, vc, bt, sl, ks, vs, **kw) -> float:
    from nvcli.kernels.decode_attention import paged_decode_attention_triton

    return kb.bench(lambda: paged_decode_attention_triton(q, kc, vc, bt, sl, 128**-0.5, ks, vs, **kw), True)


def sweep_section() -> list[str]:
    import kernels as kb

    out = []
    torch.manual_seed(0)
    dev = "cuda"
    bw = kb.copy_bandwidth(dev, True, False)
    out.append(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    cases = [("B=256 ctx=1000", [1000] * 256), ("B=64 ctx=1000", [1000] * 64),
             ("B=256 ctx 100-2000", [100 + (1900 * i) // 255 for i in range(256)])]
    for fp8 in (False, True):
        if fp8:
            configs = [dict(block_n=bn, num_warps=w, num_stages=st, f16_dot=f16)
                       for bn in (64, 128) for w in (4, 8) for st in (2, 3) for f16 in (False, True)]
        else:
            configs = [dict(block_n=bn, num_warps=4, num_stages=st) for bn in (64, 128) for st in (2, 3, 4)]
        for label, lens in cases:
            kc, vc, bt = kb.paged_kv(lens, 8, 128, 16, torch.bfloat16, dev, table_width=256)
            ks = vs = None
            elt = 2
            if fp8:
                kc, _ = kb.quantize(kc, 0.02)
                vc, _ = kb.quantize(vc, 0.02)
                ks, vs = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
                elt = 1
            q = torch.randn(len(lens), 16, 128, device=dev).to(torch.bfloat16)
            sl = kb.i32(lens, dev)
            nbytes = 2 * sum(lens) * 8 * 128 * elt
            _time_decode(kb, q, kc, vc, bt, sl, ks, vs)  # warm-up (compile, clocks)
            default = _time_decode(kb, q, kc, vc, bt, sl, ks, vs)
            results = []
            for cfg in configs:
                try:
                    results.append((_time_decode(kb, q, kc, vc, bt, sl, ks, vs, **cfg), cfg))
                except Exception as e:  # out of shared memory etc.
                    print(f"  {cfg}: {type(e).__name__}")
            results.sort(key=lambda r: r[0])
            name = f"{'fp8' if fp8 else 'bf16'} {label}"
            line = (f"{name}: default {default * 1e6:.0f} us ({nbytes / default / bw:.0%} copy); best "
                    + ", ".join(f"{'/'.join(str(v) for v in cfg.values())} {t * 1e6:.0f} us ({nbytes / t / bw:.0%})"
                                for t, cfg in results[:4]))
            print(line, flush=True)
            out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="steps,timeline,sweep")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batches", default="1,32,128,256")
    args = ap.parse_args()
    model_dir = str(preset_dir("qwen3-0.6b", Path(tempfile.mkdtemp())))
    lines: list[str] = []
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        if name == "steps":
            lines += steps_section(model_dir, [int(b) for b in args.batches.split(",")], args.kv_cache_dtype)
        elif name == "timeline":
            lines += timeline_section(model_dir, args.kv_cache_dtype)
        elif name == "sweep":
            lines += sweep_section()
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
