"""Does cuBLASLt hold faster kernels for the decoder's GEMMs than the ones torch's cuBLAS call picks?

    PYTHONPATH=. python3 benchmarks/cublaslt_gpu.py [--rows 16,64,256] [--splitk] [--rounds 3]

The GEMMs between two decode attentions (kernels.LAYER_GEMMS, plus the LM head) at the decode graphs' row
counts, 28 distinct weights per shape (cold in L2, as in a step), each in one CUDA graph:
- `torch`: `F.linear`, the engine's call;
- every algorithm `cublasLtMatmulAlgoGetHeuristic` returns for the shape (up to 64), called through ctypes on the
  library torch loaded; with `--splitk`, each of them also at split-K 2/4/8/16 where `cublasLtMatmulAlgoCheck`
  accepts it.
Each candidate's output is checked against F.linear first. Pass 1 times every candidate once; pass 2 re-times
torch, heuristic #0 and the three fastest of pass 1 in turn over `--rounds` rounds and prints us per GEMM.
The last table: us per layer (the four GEMMs) for torch against the best candidate, per row count.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

import torch
import torch.nn.functional as F
from kernels import LAYER_GEMMS, graph_medians_in_turn, graph_seconds, layer_gemm_weights

LAYERS = 28
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF = 0, 14
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE = 1
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_REDUCTION, CFG_STAGES, CFG_CLUSTER = 0, 1, 2, 3, 6, 8
WORKSPACE = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def _cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch itself loaded (after a first bf16 matmul)."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    (a @ a).sum().item()
    torch.backends.cuda.preferred_blas_library("cublas")
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcublasLt" in line})
    if not paths:
        raise SystemExit("libcublasLt is not loaded in this process")
    print("cuBLASLt:", paths[0], flush=True)
    return ctypes.CDLL(paths[0])


class Lt:
    """y [M, N] = x [M, K] @ w[N, K]^T in bf16 (fp32 accumulate), column-major: D[N, M] = op_T(W[K, N]) @ X[K, M]."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.handle = ctypes.c_void_p()
        self._ok(lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what}: status {status}")

    def problem(self, m: int, n: int, k: int) -> tuple:
        lib = self.lib
        desc = ctypes.c_void_p()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        for attr, op in [(DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)]:
            v = ctypes.c_int32(op)
            self._ok(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.c_size_t(4)), "trans")
        layouts = []
        for rows, cols, ld in [(k, n, k), (k, m, k), (n, m, n)]:
            lay = ctypes.c_void_p()
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
            layouts.append(lay)
        return desc, layouts[0], layouts[1], layouts[2]

    def heuristics(self, prob: tuple, count: int = 64) -> list[HeuristicResult]:
        desc, a, b, c = prob
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws),
                                                                ctypes.c_size_t(8)), "ws")
        results = (HeuristicResult * count)()
        returned = ctypes.c_int(0)
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                         ctypes.byref(returned)), "heuristic")
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def with_splitk(self, prob: tuple, algo: Algo, splits: int) -> Algo | None:
        """A copy of `algo` at `splits` K splits, if cublasLtMatmulAlgoCheck accepts it."""
        new = Algo()
        ctypes.memmove(ctypes.byref(new), ctypes.byref(algo), ctypes.sizeof(Algo))
        v = ctypes.c_uint32(splits)
        if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(new), CFG_SPLITK, ctypes.byref(v),
                                                            ctypes.c_size_t(4)) != 0:
            return None
        desc, a, b, c = prob
        res = HeuristicResult()
        if self.lib.cublasLtMatmulAlgoCheck(self.handle, desc, a, b, c, c, ctypes.byref(new), ctypes.byref(res)) != 0:
            return None
        return new if res.workspace <= WORKSPACE else None

    def config(self, algo: Algo) -> str:
        parts = []
        for name, attr in [("id", CFG_ID), ("tile", CFG_TILE), ("splitk", CFG_SPLITK), ("red", CFG_REDUCTION),
                           ("stages", CFG_STAGES), ("cluster", CFG_CLUSTER)]:
            v = ctypes.c_uint32(0)
            written = ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), ctypes.c_size_t(4),
                                                          ctypes.byref(written))
            parts.append(f"{name} {v.value}")
        return ", ".join(parts)

    def matmul(self, prob: tuple, algo: Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        desc, a, b, c = prob
        self._ok(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), c,
            ctypes.c_void_p(y.data_ptr()), c, ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(WORKSPACE), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "matmul")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32,48,64,96,128,192,256")
    ap.add_argument("--splitk", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    lib = _cublaslt()
    lt = Lt(lib)
    torch.manual_seed(0)
    shapes = LAYER_GEMMS + [("lm_head", 151936, 1024)]
    per_shape = zip(*layer_gemm_weights(LAYERS, "cuda"))  # each LAYER_GEMMS shape's 28 weights
    weights = {name: list(ws) for (name, _, _), ws in zip(LAYER_GEMMS, per_shape)}
    weights["lm_head"] = [torch.randn(151936, 1024, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    per_layer: dict[int, tuple[float, float]] = {}
    table = []
    for m in rows_list:
        layer_torch = layer_best = 0.0
        for name, n, k in shapes:
            ws = weights[name]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            prob = lt.problem(m, n, k)
            cands: list[tuple[str, Algo]] = []
            for i, h in enumerate(lt.heuristics(prob)):
                cands.append((f"h{i} ({lt.config(h.algo)}, waves {h.waves:.2f})", h.algo))
                if args.splitk:
                    for s in [2, 4, 8, 16]:
                        algo = lt.with_splitk(prob, h.algo, s)
                        if algo is not None:
                            cands.append((f"h{i} splitk {s} ({lt.config(algo)})", algo))
            good = []
            for label, algo in cands:
                try:
                    lt.matmul(prob, algo, x, ws[0], y)
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    print(f"  M={m} {name} {label}: {e}", flush=True)
                    continue
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                if err > 2e-2:
                    print(f"  M={m} {name} {label}: wrong (rel err {err:.2e})", flush=True)
                    continue
                good.append((label, algo))

            def torch_run(x=x, y=y, ws=ws):
                for w in ws:
                    torch.matmul(x, w.t(), out=y)

            def lt_run(algo, prob=prob, x=x, y=y, ws=ws):
                for w in ws:
                    lt.matmul(prob, algo, x, w, y)

            calls = len(ws)
            first = [(label, graph_seconds(lambda a=algo: lt_run(a), 1, 6, 1) * 1e6 / calls) for label, algo in good]
            first.sort(key=lambda t: t[1])
            keep = {"torch": torch_run}
            if good:
                keep["h0: " + good[0][0]] = lambda a=good[0][1]: lt_run(a)
            by_label = dict(good)
            for label, _ in first[:3]:
                keep.setdefault("best: " + label, lambda a=by_label[label]: lt_run(a))
            med = graph_medians_in_turn(keep, args.rounds, calls)
            t_torch = med.pop("torch")
            best_label, t_best = min(med.items(), key=lambda kv: kv[1]) if med else ("-", t_torch)
            print(f"M={m:4d} {name:8s} torch {t_torch:7.2f} us | {len(good)} candidates | "
                  + " | ".join(f"{lbl} {t:.2f}" for lbl, t in med.items()), flush=True)
            table.append((m, name, t_torch, min(t_best, t_torch), best_label if t_best < t_torch else "torch"))
            if name != "lm_head":
                layer_torch += t_torch
                layer_best += min(t_best, t_torch)
        per_layer[m] = (layer_torch, layer_best)
    print("\n| M | GEMM | torch us | best us | best |\n| --- | --- | --- | --- | --- |")
    for m, name, t0, t1, label in table:
        print(f"| {m} | {name} | {t0:.2f} | {t1:.2f} | {label} |")
    print("\n| M | layer (4 GEMMs), torch us | best cuBLASLt per GEMM | saved per step (x28) |\n| --- | --- | --- | --- |")
    for m, (t0, t1) in per_layer.items():
        print(f"| {m} | {t0:.1f} | {t1:.1f} | {(t0 - t1) * LAYERS:.0f} us |")
    print("median saved per layer:", f"{statistics.median(t0 - t1 for t0, t1 in per_layer.values()):.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
