"""Correctness and speed of the Triton KV-cache / attention kernels on the GPU.

    PYTHONPATH=. python3 benchmarks/kernels.py            # H100: checks + timings (< 2 min)
    PYTHONPATH=. python3 benchmarks/kernels.py --sweep    # + more block/warp/stage/split configs
    PYTHONPATH=. python3 benchmarks/kernels.py --smoke    # tiny shapes; on CPU via TRITON_INTERPRET=1

(a) checks every kernel against nvcli/kernels/reference.py on random bf16 inputs of
Qwen3-0.6B shapes (16 q heads, 8 kv heads, head_dim 128, block_size 16), GQA ratios 1/2/4/8,
block-boundary lengths, prefix hits, mixed batches, fp8 caches and a CUDA-graph replay with
changed seq_lens; (b) times the decode kernel (batch 1/64/256, 1000 and 4096-token contexts,
bf16 and fp8 caches) against the measured device-to-device copy bandwidth, small config
sweeps, and the prefill kernel in TFLOP/s next to torch SDPA; (c) prints a table. Exits 1
if a check failed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Report:
    checks: list[tuple[str, float, float, bool]] = field(default_factory=list)  # name, abs, rel, ok
    timings: list[tuple[str, str, float, str]] = field(default_factory=list)  # name, shape, us, metric

    def check(self, name: str, out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
        out32, ref32 = out.float(), ref.float()
        finite = bool(torch.isfinite(out32).all())
        diff = (out32 - ref32).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        max_rel = float((diff / ref32.abs().clamp_min(1e-2)).max()) if diff.numel() else 0.0
        ok = finite and bool((diff <= atol + rtol * ref32.abs()).all())
        self.checks.append((name, max_abs, max_rel, ok))
        print(
            f"  {'ok  ' if ok else 'FAIL'} {name:58s} max_abs={max_abs:.2e} max_rel={max_rel:.2e}", flush=True
        )

    def check_equal(self, name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
        mismatches = int((out.view(torch.uint8) != ref.view(torch.uint8)).sum())
        ok = mismatches == 0
        self.checks.append((name, float(mismatches), -1.0, ok))
        print(f"  {'ok  ' if ok else 'FAIL'} {name:58s} mismatched bytes={mismatches}", flush=True)


# ----------------------------------------------------------------------------- inputs


def paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    table_width: int = 0,
    gen: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with shuffled (fragmented) blocks and a padded block table."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    perm = torch.randperm(num_blocks, device="cpu", generator=gen).to(torch.int32)
    width = max(table_width, max(per_seq) + 1)
    tables = torch.full((len(seq_lens), width), int(perm[-1]), dtype=torch.int32)
    i = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = perm[i : i + n]
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(shape, device=device, dtype=torch.float32).to(dtype)
    return k, v, tables.to(device)


def quantize(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 cache as store_kvcache_triton writes it, and its dequantisation."""
    x = cache.float()
    # tensor / tensor: CUDA turns x / python_float into x * (1 / s), which rounds differently
    q = (x / torch.full_like(x, scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, q.float() * scale


def i32(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def packed_q(
    q_lens: list[int], num_heads: int, head_dim: int, dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], num_heads, head_dim, device=device).to(dtype)
    return q, i32(qsl, device)


# ----------------------------------------------------------------------------- checks


def run_checks(rep: Report, device: str, smoke: bool) -> None:
    from nvcli.kernels import reference as ref
    from nvcli.kernels.decode_attention import paged_decode_attention_triton
    from nvcli.kernels.kv_layout import PagedKV
    from nvcli.kernels.kv_store import store_kvcache_triton
    from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

    on_gpu = device == "cuda"
    # the interpreter computes bf16 wrongly: check in float32 there
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-3, 1e-3)
    head_dim = 32 if smoke and not on_gpu else 128
    block_size = 16
    scale = head_dim**-0.5
    torch.manual_seed(0)

    print("checks:", flush=True)
    # --- store
    n_tok, kvh = (37, 8) if not smoke else (9, 2)
    nb = 8
    slots = torch.randperm(nb * block_size)[:n_tok].to(device)
    slots[::7] = -1
    k = torch.randn(n_tok, kvh, head_dim, device=device).to(dtype)
    v = torch.randn(n_tok, kvh, head_dim, device=device).to(dtype)
    kc = torch.zeros(nb, block_size, kvh, head_dim, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    store_kvcache_triton(k, v, PagedKV(kc, vc), slots)
    ref.store_kvcache_ref(k, v, PagedKV(kr, vr), slots)
    rep.check_equal(f"store {dtype} kv_heads={kvh}", torch.cat([kc, vc]), torch.cat([kr, vr]))
    if on_gpu:  # the interpreter's fp32->fp8 cast mis-rounds; the GPU uses cvt.rn.satfinite
        k8 = torch.zeros(nb, block_size, kvh, head_dim, device=device, dtype=torch.float8_e4m3fn)
        v8 = torch.zeros_like(k8)
        ks, vs = torch.tensor([0.013], device=device), 0.021
        store_kvcache_triton(k * 10, v, PagedKV(k8, v8, k_scale=ks, v_scale=vs), slots)
        kr8, vr8 = torch.zeros_like(k8), torch.zeros_like(v8)
        ref.store_kvcache_ref(quantize(k * 10, 0.013)[0], quantize(v, vs)[0], PagedKV(kr8, vr8), slots)
        rep.check_equal(
            "store fp8 (tensor k_scale, float v_scale)", torch.cat([k8, v8]), torch.cat([kr8, vr8])
        )

    # --- decode: GQA ratios x block-boundary lengths, default and graph-like wide tables
    lens = [1, 15, 16, 17, 31, 32, 33, 0] + ([] if smoke else [1000, 4097])
    heads = [(16, 16), (16, 8), (32, 8), (64, 8)] if not smoke else [(4, 4), (4, 2), (8, 2), (8, 1)]
    for nh, nkv in heads:
        for width in (0, 256 if not smoke else 16):
            kc, vc, bt = paged_kv(lens, nkv, head_dim, block_size, dtype, device, table_width=width)
            q = torch.randn(len(lens), nh, head_dim, device=device).to(dtype)
            sl = i32(lens, device)
            out = paged_decode_attention_triton(q, PagedKV(kc, vc), bt, sl, scale)
            r = ref.paged_decode_attention_ref(q, PagedKV(kc, vc), bt, sl, scale)
            r[sl == 0] = 0
            rep.check(f"decode heads {nh}/{nkv} table_width={bt.shape[1]}", out, r, *tol)
    # block sizes other than 16
    for bs in (32, 64, 256) if not smoke else (64,):
        kc, vc, bt = paged_kv(lens, 8 if not smoke else 2, head_dim, bs, dtype, device)
        nh = 16 if not smoke else 4
        q = torch.randn(len(lens), nh, head_dim, device=device).to(dtype)
        sl = i32(lens, device)
        out = paged_decode_attention_triton(q, PagedKV(kc, vc), bt, sl, scale)
        r = ref.paged_decode_attention_ref(q, PagedKV(kc, vc), bt, sl, scale)
        r[sl == 0] = 0
        rep.check(f"decode block_size={bs}", out, r, *tol)

    # --- decode fp8
    nh, nkv = (16, 8) if not smoke else (4, 2)
    kc, vc, bt = paged_kv(lens, nkv, head_dim, block_size, dtype, device)
    k8, kd = quantize(kc, 0.02)
    v8, vd = quantize(vc, 0.03)
    q = torch.randn(len(lens), nh, head_dim, device=device).to(dtype)
    sl = i32(lens, device)
    for name, ks, vs in (("float", 0.02, 0.03), ("tensor", torch.tensor([0.02], device=device), None)):
        vs = vs if vs is not None else torch.tensor(0.03, device=device)
        out = paged_decode_attention_triton(q, PagedKV(k8, v8, k_scale=ks, v_scale=vs), bt, sl, scale)
        r = ref.paged_decode_attention_ref(q, PagedKV(kd, vd), bt, sl, scale)
        r[sl == 0] = 0
        rep.check(f"decode fp8 cache ({name} scales)", out, r, *tol)

    # --- decode under a CUDA graph, replayed with different seq_lens / tables
    if on_gpu:
        nb_graph = 64
        kc, vc, _ = paged_kv([nb_graph * block_size], 8, head_dim, block_size, dtype, device)
        g_kv = PagedKV(kc, vc)
        g_q = torch.randn(4, 16, head_dim, device=device).to(dtype)
        g_bt = torch.zeros(4, nb_graph, dtype=torch.int32, device=device)
        g_sl = torch.zeros(4, dtype=torch.int32, device=device)
        paged_decode_attention_triton(g_q, g_kv, g_bt, g_sl, scale)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = paged_decode_attention_triton(g_q, g_kv, g_bt, g_sl, scale)
        for trial_lens in ([5, 300, 0, 17], [1000, 1, 64, 33]):
            g_bt.copy_(torch.stack([torch.randperm(nb_graph, device=device) for _ in range(4)]).int())
            g_sl.copy_(i32(trial_lens, device))
            g_q.copy_(torch.randn_like(g_q))
            graph.replay()
            r = ref.paged_decode_attention_ref(g_q, g_kv, g_bt, g_sl, scale)
            r[g_sl == 0] = 0
            rep.check(f"decode CUDA-graph replay lens={trial_lens}", g_out, r, *tol)

    # --- prefill: full prompts, prefix hits, chunked prefill, decodes, q_len 0
    if smoke:
        seq_l, q_l = [33, 40, 17, 5, 9], [33, 24, 1, 3, 0]
    else:
        seq_l, q_l = [1024, 300, 17, 33, 4097, 16, 1, 129], [1024, 44, 1, 33, 512, 16, 1, 0]
    for nh, nkv in heads:
        kc, vc, bt = paged_kv(seq_l, nkv, head_dim, block_size, dtype, device)
        q, qsl = packed_q(q_l, nh, head_dim, dtype, device)
        sl = i32(seq_l, device)
        out = paged_prefill_attention_triton(q, PagedKV(kc, vc), qsl, sl, bt, max(q_l), max(seq_l), scale)
        r = ref.paged_attention_ref(q, PagedKV(kc, vc), qsl, sl, bt, scale)
        rep.check(f"prefill mixed batch heads {nh}/{nkv}", out, r, *tol)
    nh, nkv = (16, 8) if not smoke else (4, 2)
    for bs in (32, 256) if not smoke else (64,):
        kc, vc, bt = paged_kv(seq_l, nkv, head_dim, bs, dtype, device)
        q, qsl = packed_q(q_l, nh, head_dim, dtype, device)
        sl = i32(seq_l, device)
        out = paged_prefill_attention_triton(q, PagedKV(kc, vc), qsl, sl, bt, max(q_l), max(seq_l), scale)
        r = ref.paged_attention_ref(q, PagedKV(kc, vc), qsl, sl, bt, scale)
        rep.check(f"prefill block_size={bs}", out, r, *tol)
    kc, vc, bt = paged_kv(seq_l, nkv, head_dim, block_size, dtype, device)
    k8, kd = quantize(kc, 0.02)
    v8, vd = quantize(vc, 0.03)
    q, qsl = packed_q(q_l, nh, head_dim, dtype, device)
    sl = i32(seq_l, device)
    kv8 = PagedKV(k8, v8, k_scale=torch.tensor(0.02, device=device), v_scale=0.03)
    out = paged_prefill_attention_triton(q, kv8, qsl, sl, bt, max(q_l), max(seq_l), scale)
    r = ref.paged_attention_ref(q, PagedKV(kd, vd), qsl, sl, bt, scale)
    rep.check("prefill fp8 cache", out, r, *tol)

    # --- fused residual add + RMSNorm
    from nvcli.kernels.rms_norm import rms_norm_triton

    hidden = 1024 if not smoke else 96
    x = torch.randn(67, hidden, device=device).to(dtype)
    res = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    out, new_res = rms_norm_triton(x, w, 1e-6, res)
    s = (x.float() + res.float()).to(dtype)
    sf = s.float()
    r = w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    rep.check("rms_norm + residual", out, r, *tol)
    rep.check_equal("rms_norm new residual", new_res, s)


# ----------------------------------------------------------------------------- timings


def bench(fn: Callable[[], object], on_gpu: bool) -> float:
    """Median seconds per call."""
    if on_gpu:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def graph_seconds(run: Callable[[], object], warm_runs: int, replays: int, skip: int) -> float:
    """Median seconds of one replay of a CUDA graph of `run`: `run` goes `warm_runs` times on a side stream first
    (compiles, cuBLAS handles: nothing of that may happen inside the capture), then the graph is replayed
    `replays` times under CUDA events and the first `skip` replays are dropped."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm_runs):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for i in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= skip:
            times.append(start.elapsed_time(end) * 1e-3)
    del graph
    return statistics.median(times)


def copy_bandwidth(device: str, on_gpu: bool, smoke: bool) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write."""
    n = (1 << 28) if on_gpu and not smoke else (1 << 20)  # 512 MiB of bf16 on the GPU
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), on_gpu)
    return 2 * src.numel() * src.element_size() / t


def run_timings(rep: Report, device: str, smoke: bool, sweep: bool) -> None:
    from nvcli.kernels.decode_attention import choose_num_splits, paged_decode_attention_triton
    from nvcli.kernels.kv_layout import PagedKV
    from nvcli.kernels.prefill_attention import paged_prefill_attention_triton

    on_gpu = device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    num_heads, num_kv_heads, head_dim, block_size = (16, 8, 128, 16) if not smoke else (4, 2, 32, 16)
    scale = head_dim**-0.5
    elt = torch.empty(0, dtype=dtype).element_size()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 132

    bw = copy_bandwidth(device, on_gpu, smoke)
    rep.timings.append(
        (
            "copy bandwidth (read+write)",
            "512 MiB" if on_gpu and not smoke else "2 MiB",
            0.0,
            f"{bw / 1e9:.0f} GB/s",
        )
    )
    print(f"timings: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    def decode_case(batch: int, ctx: int, fp8: bool, label_extra: str = "", **kw) -> float:
        lens = [ctx] * batch
        kc, vc, bt = paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device)
        ks = vs = None
        cache_elt = elt
        if fp8:
            kc, _ = quantize(kc, 0.02)
            vc, _ = quantize(vc, 0.02)
            ks, vs = torch.tensor([0.02], device=device), torch.tensor([0.02], device=device)
            cache_elt = 1
        q = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
        sl = i32(lens, device)
        kv = PagedKV(kc, vc, ks, vs)
        t = bench(lambda: paged_decode_attention_triton(q, kv, bt, sl, scale, **kw), on_gpu)
        nbytes = 2 * batch * ctx * num_kv_heads * head_dim * cache_elt + 2 * q.numel() * elt + bt.numel() * 4
        splits = kw.get("num_splits") or choose_num_splits(
            batch, num_kv_heads, bt.shape[1] * block_size, kw.get("block_n") or 64, num_sms
        )
        name = f"decode {'fp8' if fp8 else str(dtype).split('.')[-1]}{label_extra}"
        shape = f"B={batch} ctx={ctx} splits={splits}"
        rep.timings.append(
            (name, shape, t * 1e6, f"{nbytes / t / 1e9:.0f} GB/s = {100 * nbytes / t / bw:.0f}% copy")
        )
        print(
            f"  {name:34s} {shape:28s} {t * 1e6:9.1f} us  {nbytes / t / 1e9:7.0f} GB/s  {100 * nbytes / t / bw:5.1f}%",
            flush=True,
        )
        return t

    cases = [(1, 1000), (64, 1000), (256, 1000), (1, 4096), (64, 4096), (256, 4096)]
    if smoke:
        cases = [(1, 40), (4, 40)]
    for batch, ctx in cases:
        decode_case(batch, ctx, False)
    for batch, ctx in cases if not smoke else cases[:1]:
        if batch >= 64 or smoke:
            decode_case(batch, ctx, True)

    if not smoke:
        # config sweeps at the target shape (B=256, 1000 tokens) and the split counts
        configs = [(32, 4, 4), (64, 4, 4), (128, 8, 3)]
        splits = [(64, 1), (64, 4), (256, 2)]
        if sweep:
            configs += [(32, 4, 3), (64, 4, 2), (64, 8, 3), (128, 4, 3), (128, 8, 2)]
            splits += [(64, 8), (256, 4)]
        for bn, nw, ns in configs:
            decode_case(256, 1000, False, f" bn={bn} w={nw} st={ns}", block_n=bn, num_warps=nw, num_stages=ns)
        for batch, n in splits:
            decode_case(batch, 1000, False, f" splits={n}", num_splits=n)

    # prefill: 8 prompts x 1024 tokens (causal), TFLOP/s, next to torch SDPA (contiguous K/V)
    n_prompts, plen = (8, 1024) if not smoke else (2, 40)
    lens = [plen] * n_prompts
    kc, vc, bt = paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device)
    kv = PagedKV(kc, vc)
    q, qsl = packed_q(lens, num_heads, head_dim, dtype, device)
    sl = i32(lens, device)
    flops = 2 * 2 * num_heads * head_dim * sum(n * (n + 1) / 2 for n in lens)  # QK^T and PV, causal half

    def prefill_case(label: str, **kw) -> None:
        t = bench(
            lambda: paged_prefill_attention_triton(q, kv, qsl, sl, bt, plen, plen, scale, **kw), on_gpu
        )
        shape = f"{n_prompts}x{plen} tokens"
        rep.timings.append((f"prefill{label}", shape, t * 1e6, f"{flops / t / 1e12:.0f} TFLOP/s"))
        print(
            f"  prefill{label:27s} {shape:28s} {t * 1e6:9.1f} us  {flops / t / 1e12:7.1f} TFLOP/s", flush=True
        )

    prefill_case("")
    rms_norm_timing(rep, device, dtype, bw, smoke)
    if not smoke:
        configs = [(128, 64, 8, 4), (64, 64, 4, 3)]
        if sweep:
            configs += [(128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 8, 4), (64, 32, 4, 4)]
        for bm, bn, nw, ns in configs:
            prefill_case(
                f" bm={bm} bn={bn} w={nw} st={ns}", block_m=bm, block_n=bn, num_warps=nw, num_stages=ns
            )
    if on_gpu:
        import torch.nn.functional as F

        qs = q.view(n_prompts, plen, num_heads, head_dim).transpose(1, 2)
        ks = torch.randn(n_prompts, num_kv_heads, plen, head_dim, device=device).to(dtype)
        vs = torch.randn_like(ks)
        t = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True), on_gpu)
        rep.timings.append(
            (
                "torch SDPA (contiguous, reference)",
                f"{n_prompts}x{plen} tokens",
                t * 1e6,
                f"{flops / t / 1e12:.0f} TFLOP/s",
            )
        )
        print(
            f"  torch SDPA                         {t * 1e6:9.1f} us  {flops / t / 1e12:7.1f} TFLOP/s",
            flush=True,
        )


def rms_norm_timing(rep: Report, device: str, dtype: torch.dtype, bw: float, smoke: bool) -> None:
    from nvcli.kernels.rms_norm import rms_norm_triton

    on_gpu = device == "cuda"
    rows, hidden = (8192, 1024) if not smoke else (8, 96)
    x = torch.randn(rows, hidden, device=device).to(dtype)
    res = torch.randn_like(x)
    w = torch.ones(hidden, device=device, dtype=dtype)
    t = bench(lambda: rms_norm_triton(x, w, 1e-6, res), on_gpu)
    nbytes = 4 * x.numel() * x.element_size()  # read x, residual; write out, new residual
    shape = f"{rows}x{hidden} +residual"
    rep.timings.append(
        ("rms_norm", shape, t * 1e6, f"{nbytes / t / 1e9:.0f} GB/s = {100 * nbytes / t / bw:.0f}% copy")
    )
    print(f"  {'rms_norm':34s} {shape:28s} {t * 1e6:9.1f} us  {nbytes / t / 1e9:7.0f} GB/s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    parser.add_argument("--skip-timings", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="more kernel configs (adds ~1 min)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.smoke:
            print("no CUDA device: run with --smoke (Triton interpreter, tiny shapes)")
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules import triton
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        print(f"device: {torch.cuda.get_device_name(0)}  torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    rep = Report()
    run_checks(rep, device, args.smoke)
    if not args.skip_timings:
        run_timings(rep, device, args.smoke, args.sweep)

    print("\n" + "=" * 100)
    failed = [c for c in rep.checks if not c[3]]
    close = [c[1] for c in rep.checks if c[2] >= 0]  # tolerance checks (not bitwise ones)
    worst = f"; worst max_abs err {max(close):.2e}" if close else ""
    print(f"checks: {len(rep.checks) - len(failed)}/{len(rep.checks)} passed{worst}")
    for name, *_ in failed:
        print(f"  FAILED: {name}")
    if rep.timings:
        print(f"{'kernel':44s} {'shape':28s} {'time':>11s}  metric")
        for name, shape, us, metric in rep.timings:
            t = f"{us:9.1f} us" if us else ""
            print(f"{name:44s} {shape:28s} {t:>11s}  {metric}")
    print(f"total {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
