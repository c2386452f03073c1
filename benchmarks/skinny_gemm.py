"""Skinny (M <= 16) Triton GEMM against cuBLAS (F.linear) on the decode shapes of Qwen3 models.

    PYTHONPATH=. python3 benchmarks/skinny_gemm.py            # H100: checks + timings (< 90 s)
    PYTHONPATH=. python3 benchmarks/skinny_gemm.py --sweep    # + a config sweep per shape (minutes)
    PYTHONPATH=. python3 benchmarks/skinny_gemm.py --smoke    # tiny shapes; on CPU via TRITON_INTERPRET=1

For every layer shape of Qwen3-0.6B (qkv, o, gate_up, down, lm_head) and Qwen3-8B (qkv, o,
gate_up, down) and M in 1, 2, 4, 8, 16 (bf16):
(a) checks skinny_linear_triton and F.linear against an fp32 matmul of the same bf16
    inputs (max |err| / max |ref|), bias and split-K determinism on some shapes, and a
    CUDA-graph replay with new inputs;
(b) times both inside a CUDA graph that calls the layer on enough distinct copies of the
    weight (>= 256 MiB in all) that every call streams its weight from HBM, as in a
    decode step; the median over replays divided by the calls is the time per call, and
    weight bytes / time the achieved bandwidth (a 512 MiB device copy, read + write, is
    printed for scale);
(c) prints a table and, per model and M, the estimated GEMM time of one decode step
    (layers x (qkv + o + gate_up + down) + lm_head). Exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kernels import graph_seconds


@dataclass(frozen=True)
class Shape:
    model: str
    layer: str
    n: int
    k: int
    per_step: int  # calls per decode step (number of layers; 1 for lm_head)


def model_shapes(smoke: bool) -> list[Shape]:
    if smoke:
        return [
            Shape("tiny", "qkv", 48, 64, 2),
            Shape("tiny", "o", 24, 96, 2),
            Shape("tiny", "down", 40, 320, 2),
        ]
    return [
        Shape("qwen3-0.6b", "qkv", 4096, 1024, 28),
        Shape("qwen3-0.6b", "o", 1024, 2048, 28),
        Shape("qwen3-0.6b", "gate_up", 6144, 1024, 28),
        Shape("qwen3-0.6b", "down", 1024, 3072, 28),
        Shape("qwen3-0.6b", "lm_head", 151936, 1024, 1),
        Shape("qwen3-8b", "qkv", 6144, 4096, 36),
        Shape("qwen3-8b", "o", 4096, 4096, 36),
        Shape("qwen3-8b", "gate_up", 24576, 4096, 36),
        Shape("qwen3-8b", "down", 4096, 12288, 36),
    ]


class Checks:
    def __init__(self) -> None:
        self.results: list[tuple[str, bool]] = []

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.results.append((name, ok))
        print(f"  {'ok  ' if ok else 'FAIL'} {name:50s} {detail}", flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (normwise: bf16 rounding of the output is ~4e-3 of an element)."""
    out32, ref32 = out.float(), ref.float()
    if not bool(torch.isfinite(out32).all()):
        return math.inf
    return float((out32 - ref32).abs().max() / ref32.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------- timing


def graph_time(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor]
) -> float:
    """Seconds per call of fn(x, w) over the weight copies, inside one CUDA graph (median of replays)."""

    def run() -> None:
        for w in ws:
            fn(x, w)

    return graph_seconds(run, warm_runs=1, replays=16, skip=1) / len(ws)


def cpu_time(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor]
) -> float:
    t = time.perf_counter()
    fn(x, ws[0])
    return time.perf_counter() - t


def copy_bandwidth(on_gpu: bool) -> float:
    """Bytes/s of a 512 MiB device-to-device copy, counting read + write."""
    if not on_gpu:
        return 0.0
    import triton.testing

    src = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") * 1e-3
    return 2 * (1 << 28) * 2 / t


# ----------------------------------------------------------------------------- main parts


def make_weights(shape: Shape, dtype: torch.dtype, device: str, on_gpu: bool) -> list[torch.Tensor]:
    nbytes = shape.n * shape.k * torch.empty(0, dtype=dtype).element_size()
    copies = min(64, max(2, math.ceil((256 << 20) / nbytes))) if on_gpu else 1
    scale = shape.k**-0.5
    return [(torch.randn(shape.n, shape.k, device=device) * scale).to(dtype) for _ in range(copies)]


def check_shape(
    checks: Checks, shape: Shape, ms: list[int], w: torch.Tensor, device: str, bias: bool
) -> None:
    from nvcli.kernels.skinny_gemm import choose_config, num_sms, skinny_linear_triton

    tol = 8e-3 if w.dtype != torch.float32 else 1e-5
    gen = torch.Generator(device=device).manual_seed(shape.n + shape.k)
    for m in ms:
        x = torch.randn(m, shape.k, device=device, generator=gen).to(w.dtype)
        ref = x.float() @ w.float().T
        y = skinny_linear_triton(x, w)
        err, err_cublas = rel_err(y, ref), rel_err(F.linear(x, w), ref)
        cfg = choose_config(m, shape.n, shape.k, w.element_size(), num_sms(w.device))
        name = f"{shape.model} {shape.layer} M={m}"
        checks.add(name, err <= tol, f"rel err {err:.1e} (cuBLAS {err_cublas:.1e})")
        if cfg.split_k > 1:
            checks.add(
                f"{name} split-K={cfg.split_k} bitwise repeat", torch.equal(y, skinny_linear_triton(x, w)), ""
            )
    for m in (1, ms[-1]) if bias else ():  # bias, both inner products
        x = torch.randn(m, shape.k, device=device, generator=gen).to(w.dtype)
        b = torch.randn(shape.n, device=device, generator=gen).to(w.dtype)
        err = rel_err(skinny_linear_triton(x, w, b), x.float() @ w.float().T + b.float())
        checks.add(f"{shape.model} {shape.layer} M={m} +bias", err <= tol, f"rel err {err:.1e}")


def check_graph(checks: Checks, w: torch.Tensor, m: int) -> None:
    """Capture once, replay with new x contents: same result as an eager call."""
    from nvcli.kernels.skinny_gemm import skinny_linear_triton

    x = torch.randn(m, w.shape[1], device="cuda").to(w.dtype)
    skinny_linear_triton(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear_triton(x, w)
    x.copy_(torch.randn_like(x, dtype=torch.float32).to(w.dtype))
    graph.replay()
    torch.cuda.synchronize()
    checks.add(
        f"CUDA-graph replay, new x, M={m} {tuple(w.shape)}", torch.equal(y, skinny_linear_triton(x, w)), ""
    )


@dataclass
class Row:
    shape: Shape
    m: int
    wbytes: int
    t_cublas: float
    t_skinny: float
    config: str


def sweep_candidates(m: int, n: int, k: int) -> list:
    from nvcli.kernels.skinny_gemm import FMA_MAX_M, TILE_BYTES, SkinnyConfig, block_m_for

    tile = TILE_BYTES // 2
    kp = 1 << max(4, (k - 1).bit_length())
    out = []
    if m <= 2 * FMA_MAX_M:
        warps = min(16, 4 * block_m_for(m, False))
        for bn in (4, 16, 64):
            for split in (1, 4):
                for stages in (1, 3):
                    out.append(SkinnyConfig(bn, min(kp, tile // bn), split, False, warps, stages))
    if m > 1:
        for bn, bk in ((32, 256), (64, 128)):
            for split in (1, 4):
                for stages in (2, 4):
                    out.append(SkinnyConfig(bn, min(bk, kp), split, True, 4, stages))
    return out


def run_sweep(shapes: list[Shape], weights: dict[Shape, list[torch.Tensor]], ms: list[int]) -> None:
    from nvcli.kernels.skinny_gemm import choose_config, num_sms, skinny_linear_triton

    print("\nsweep: best config per shape (time per call in a CUDA graph, cold weights)", flush=True)
    for shape in shapes:
        ws = weights[shape]
        for m in ms:
            x = torch.randn(m, shape.k, device="cuda").to(torch.bfloat16)
            auto = choose_config(m, shape.n, shape.k, 2, num_sms(x.device))
            results = []
            for cfg in sweep_candidates(m, shape.n, shape.k):
                try:
                    t = graph_time(lambda a, b, c=cfg: skinny_linear_triton(a, b, config=c), x, ws)
                except Exception as e:  # out of shared memory / registers: skip the config
                    print(f"    skip {cfg}: {type(e).__name__}", flush=True)
                    continue
                results.append((t, cfg))
            t_auto = graph_time(lambda a, b: skinny_linear_triton(a, b), x, ws)
            results.sort(key=lambda r: r[0])
            best_t, best = results[0]
            print(
                f"  {shape.model:10s} {shape.layer:8s} M={m:2d}  auto {t_auto * 1e6:6.1f} us {fmt(auto)}  "
                f"best {best_t * 1e6:6.1f} us {fmt(best)}",
                flush=True,
            )
            for t, cfg in results[1:4]:
                print(f"  {'':31s}{'':16s}  next {t * 1e6:6.1f} us {fmt(cfg)}", flush=True)


def fmt(cfg) -> str:
    kind = "dot" if cfg.use_dot else "fma"
    return f"{kind} n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    parser.add_argument(
        "--sweep", action="store_true", help="also time a grid of configs per shape (M 1, 4, 16)"
    )
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.smoke:
            print("no CUDA device: run with --smoke (Triton interpreter, tiny shapes)")
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module imports triton
    from nvcli.kernels.skinny_gemm import choose_config, num_sms, skinny_linear_triton

    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32  # the interpreter's bf16 math is not the GPU's
    ms = [1, 2, 4, 8, 16] if not args.smoke else [1, 3, 16]
    sms = num_sms(torch.device(device))
    start = time.perf_counter()
    if on_gpu:
        print(f"device: {torch.cuda.get_device_name(0)} ({sms} SMs)  torch {torch.__version__}", flush=True)
    bw = copy_bandwidth(on_gpu)
    timer = graph_time if on_gpu else cpu_time

    checks = Checks()
    rows: list[Row] = []
    shapes = model_shapes(args.smoke)
    weights: dict[Shape, list[torch.Tensor]] = {}
    for shape in shapes:
        ws = make_weights(shape, dtype, device, on_gpu)
        if args.sweep and shape.model == "qwen3-0.6b":
            weights[shape] = ws
        check_shape(checks, shape, ms, ws[0], device, bias=shape.model != "qwen3-8b")  # fewer compiles
        if on_gpu and shape == shapes[1]:
            check_graph(checks, ws[0], 1)
            check_graph(checks, ws[0], 16)
        wbytes = ws[0].numel() * ws[0].element_size()
        for m in ms:
            x = torch.randn(m, shape.k, device=device).to(dtype)
            t_cublas = timer(lambda a, b: F.linear(a, b), x, ws)
            t_skinny = timer(lambda a, b: skinny_linear_triton(a, b), x, ws)
            cfg = choose_config(m, shape.n, shape.k, ws[0].element_size(), sms)
            rows.append(Row(shape, m, wbytes, t_cublas, t_skinny, fmt(cfg)))
        del ws

    print("\n" + "=" * 118)
    failed = [name for name, ok in checks.results if not ok]
    print(f"checks: {len(checks.results) - len(failed)}/{len(checks.results)} passed")
    for name in failed:
        print(f"  FAILED: {name}")
    if on_gpu:
        print(f"copy bandwidth (512 MiB, read+write): {bw / 1e9:.0f} GB/s")
    else:
        print("(Triton interpreter on CPU: the times below only show that the script runs)")
    print(
        f"{'model':11s} {'layer':8s} {'N x K':>13s} {'M':>3s} {'MB':>6s} {'cuBLAS us':>10s} {'skinny us':>10s} "
        f"{'cuBLAS GB/s':>12s} {'skinny GB/s':>12s} {'speedup':>8s}  config"
    )
    for r in rows:
        print(
            f"{r.shape.model:11s} {r.shape.layer:8s} {f'{r.shape.n}x{r.shape.k}':>13s} {r.m:3d} "
            f"{r.wbytes / 1e6:6.1f} {r.t_cublas * 1e6:10.1f} {r.t_skinny * 1e6:10.1f} "
            f"{r.wbytes / r.t_cublas / 1e9:12.0f} {r.wbytes / r.t_skinny / 1e9:12.0f} "
            f"{r.t_cublas / r.t_skinny:7.2f}x  {r.config}"
        )
    print("\nper decode step (layers x (qkv + o + gate_up + down) + lm_head), GEMMs only:")
    for model in dict.fromkeys(s.model for s in shapes):
        for m in ms:
            sel = [r for r in rows if r.shape.model == model and r.m == m]
            tc = sum(r.t_cublas * r.shape.per_step for r in sel)
            ts = sum(r.t_skinny * r.shape.per_step for r in sel)
            best = sum(min(r.t_cublas, r.t_skinny) * r.shape.per_step for r in sel)
            print(
                f"  {model:11s} M={m:2d}  cuBLAS {tc * 1e3:7.3f} ms  skinny {ts * 1e3:7.3f} ms  "
                f"best-of-both {best * 1e3:7.3f} ms  saves {(tc - best) * 1e3:6.3f} ms"
            )
    if args.sweep and on_gpu:
        sweep_ms = [m for m in (1, 4, 16) if m in ms]
        run_sweep(list(weights), weights, sweep_ms)
    print(f"total {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
