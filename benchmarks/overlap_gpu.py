"""Can one half of a decode batch run its GEMMs while the other half runs attention, on split SMs?

    PYTHONPATH=. python3 benchmarks/overlap_gpu.py [--ms 64,128,256]

Session 14's question. A big decode step is, per layer, ~300 us of bandwidth-bound attention and then
~45 us of a latency-bound chain (four cuBLAS GEMMs and small kernels) that leaves most of the GPU idle.
Session 3 split the batch in two halves on two streams (half A's GEMMs beside half B's attention) and
lost: attention's programs took every SM, so the GEMMs waited anyway, and each half read the weights.
This probe asks whether the GEMM half can get SMs of its own: (a) a high-priority stream, so the block
scheduler hands the GEMMs SMs as attention programs retire; (b) green contexts (CUDA 12.4+), which split
the SMs: k for the GEMMs, the rest for attention.

Stand-ins, 28 layers, weights distinct per layer: attention = a kernel streaming M * 8 programs x T
tokens of 512 bytes (a head's K and V), the GEMM chain = o_proj, gate_up, down, qkv at the half's rows.
Variants, each timed both as a CUDA graph and eagerly (a cell reads "failed" where that mode raised):
- serial: attention(M) then GEMMs(M) per layer (what the engine does);
- pipelined: attention(A), attention(B) on one stream; GEMMs(A) after attention(A), GEMMs(B) after
  attention(B) on another; attention(A) of the next layer after GEMMs(A).
Time per layer, median of rounds run in turn.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernels import graph_seconds, layer_gemm_weights

TOKENS = {64: 1400, 128: 1000, 256: 800}


@triton.jit
def _stream_kernel(kv_ptr, out_ptr, tokens, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    base = kv_ptr + pid.to(tl.int64) * tokens * 256
    offs = tl.arange(0, BLOCK_T)[:, None] * 256 + tl.arange(0, 256)[None, :]
    acc = tl.zeros([BLOCK_T, 256], dtype=tl.float32)
    for t in range(0, tokens, BLOCK_T):
        mask = (t + tl.arange(0, BLOCK_T))[:, None] < tokens
        acc += tl.load(base + t * 256 + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


class GreenSplit:
    """Two green contexts over disjoint SMs (driver API through ctypes): `small` SMs and the rest."""

    def __init__(self, small: int):
        cu = ctypes.CDLL("libcuda.so.1")

        def check(rc, what):
            if rc != 0:
                raise RuntimeError(f"{what} failed: CUresult {rc}")

        torch.cuda.init()
        dev = ctypes.c_int()
        check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        whole = ctypes.create_string_buffer(4096)
        check(cu.cuDeviceGetDevResource(dev, whole, 1), "cuDeviceGetDevResource")  # CU_DEV_RESOURCE_TYPE_SM
        group, rest = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(4096)
        n = ctypes.c_uint(1)
        check(cu.cuDevSmResourceSplitByCount(group, ctypes.byref(n), whole, rest, 0, ctypes.c_uint(small)),
              "cuDevSmResourceSplitByCount")
        self.sm_counts = (ctypes.c_uint.from_buffer(group, 96).value, ctypes.c_uint.from_buffer(rest, 96).value)
        self.streams = []
        for res in (group, rest):
            desc = ctypes.c_void_p()
            check(cu.cuDevResourceGenerateDesc(ctypes.byref(desc), res, 1), "cuDevResourceGenerateDesc")
            ctx = ctypes.c_void_p()
            check(cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, 1), "cuGreenCtxCreate")
            stream = ctypes.c_void_p()
            check(cu.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, 1, 0), "cuGreenCtxStreamCreate")  # non-blocking
            self.streams.append(torch.cuda.ExternalStream(stream.value))


def timed(fn, graph: bool, reps: int = 10) -> float:
    """us of one call of fn: as a CUDA graph when `graph` (kernels.graph_seconds), else eagerly (wall time, median
    of reps after one warm call)."""
    if graph:
        return graph_seconds(fn, warm_runs=1, replays=reps + 1, skip=1) * 1e6
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(m: int, layers: int, rounds: int, weights: list, splits: dict) -> list[str]:
    """Table rows for batch size m."""
    dev = "cuda"
    lines = []
    tokens, h = TOKENS.get(m, 1000), m // 2
    kv = torch.randn(m * 8 * tokens * 256, device=dev, dtype=torch.bfloat16)
    sums = torch.empty(m * 8, device=dev, dtype=torch.float32)
    x0 = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
    acts = [x0[:h], x0[h:]]

    def attention(rows: slice):
        programs = (rows.stop - rows.start) * 8
        _stream_kernel[(programs,)](kv[rows.start * 8 * tokens * 256:], sums[rows.start * 8:], tokens,
                                    BLOCK_T=16, num_warps=4)

    def gemms(x, layer):
        for w in weights[layer]:
            x = F.linear(x[:, :w.shape[1]], w)
        return x

    def serial():
        x = x0
        for layer in range(layers):
            attention(slice(0, m))
            x = gemms(x, layer)

    def pipelined(s_attn: torch.cuda.Stream, s_gemm: torch.cuda.Stream):
        def run():
            cur = torch.cuda.current_stream()
            s_attn.wait_stream(cur)
            s_gemm.wait_stream(cur)
            done_gemm = [None, None]
            xs = list(acts)
            for layer in range(layers):
                for half in range(2):
                    rows = slice(0, h) if half == 0 else slice(h, m)
                    with torch.cuda.stream(s_attn):
                        if done_gemm[half] is not None:
                            s_attn.wait_event(done_gemm[half])
                        attention(rows)
                        done_attn = torch.cuda.Event()
                        done_attn.record(s_attn)
                    with torch.cuda.stream(s_gemm):
                        s_gemm.wait_event(done_attn)
                        xs[half] = gemms(xs[half], layer)
                        done_gemm[half] = torch.cuda.Event()
                        done_gemm[half].record(s_gemm)
            cur.wait_stream(s_attn)
            cur.wait_stream(s_gemm)
        return run

    variants = {"serial": serial,
                "pipelined, plain streams": pipelined(torch.cuda.Stream(), torch.cuda.Stream()),
                "pipelined, GEMMs high priority": pipelined(torch.cuda.Stream(), torch.cuda.Stream(priority=-1))}
    for k, split in splits.items():
        variants[f"pipelined, green {split.sm_counts[1]}/{split.sm_counts[0]} SMs"] = pipelined(
            split.streams[1], split.streams[0])
        variants[f"pipelined, GEMMs green {k}, attention all SMs"] = pipelined(torch.cuda.Stream(),
                                                                              split.streams[0])
    res: dict[str, dict[str, list[float]]] = {v: {"graph": [], "eager": []} for v in variants}
    for r in range(rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            for mode in ("graph", "eager"):
                try:
                    res[name][mode].append(timed(variants[name], mode == "graph") / layers)
                except Exception as e:
                    if r == 0:
                        print(f"M={m} {name} {mode}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        traceback.print_exc(limit=2)
                    torch.cuda.synchronize()
    for name in variants:
        cells = [f"{statistics.median(res[name][mode]):.1f}" if res[name][mode] else "failed"
                 for mode in ("graph", "eager")]
        lines.append(f"| {m} | {name} | {cells[0]} | {cells[1]} |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,128,256")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--green", default="16,24,32", help="SM counts for the GEMM partition")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    layers = args.layers
    weights = layer_gemm_weights(layers, dev)
    splits: dict[int, GreenSplit] = {}
    for k in [int(v) for v in args.green.split(",") if v]:
        try:
            splits[k] = GreenSplit(k)
            print(f"green split {k}: SMs {splits[k].sm_counts}", flush=True)
        except Exception as e:  # driver without green contexts
            print(f"green split {k}: {e}", flush=True)
    lines = ["| M | variant | graph us/layer | eager us/layer |", "| --- | --- | --- | --- |"]
    for m in [int(v) for v in args.ms.split(",")]:
        lines += measure(m, layers, args.rounds, weights, splits)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
