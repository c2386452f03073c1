"""Programmatic edges into cuBLAS kernels inside a CUDA graph: would they be safe?

    PYTHONPATH=.:benchmarks python3 benchmarks/graph_pdl_gpu.py [--rows 32,128,256] [--sections probe,candidates]

A decode step's chain is cuBLAS GEMM -> our kernel -> cuBLAS GEMM -> ...; torch launches cuBLAS without
programmatic dependent launch (PDL), so every edge into a GEMM waits for the previous kernel to finish and flush
before the GEMM's grid launches. A captured graph can be edited: an edge turned programmatic
(cuGraphAddDependencies_v2, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC) lets the downstream kernel launch while the
upstream one finishes. That is only correct if the downstream kernel executes `griddepcontrol.wait` before it
reads what the upstream kernel wrote; CUTLASS-built kernels compile it in (a no-op without PDL). Whether the
cuBLAS kernels torch picks here do is not documented, so:

probe: for every GEMM shape of a decode layer (qkv, o_proj + residual, gate_up, down + residual) at each row count,
  a one-program Triton kernel lets dependents launch, spins for 30 us, then writes the GEMM's input; the edge from
  it to the GEMM's kernel is made programmatic. A kernel that waits reads the new input (right answer); one that
  does not reads the old one. Controls: a Triton reader without the wait (must read stale data, or the edge did
  nothing) and with it (must read the new data).
candidates: the same test for every algorithm cuBLASLt's heuristic offers for those shapes (cublaslt_gpu.py's
  ctypes binding), with the kernels' names.

Answer on the H100 (RESULTS session 22): no kernel waits, torch's or any candidate's (nvjet_sm90_tst_*, cuBLASLt's
split-K reduce): all of them read the stale input, so the edges into cuBLAS must stay plain.
"""

from __future__ import annotations

import argparse
import ctypes

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_cuda = ctypes.CDLL("libcuda.so.1") if torch.cuda.is_available() else None  # None: compile checks only
CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1
CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KernelNodeParams(ctypes.Structure):
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _cuda.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUDA driver error {rc} ({name.value})")


def graph_edges(graph: int) -> list[tuple[int, int, EdgeData]]:
    n = ctypes.c_size_t(0)
    _check(_cuda.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)), "cuGraphGetEdges_v2")
    frm, to, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (EdgeData * n.value)()
    _check(_cuda.cuGraphGetEdges_v2(ctypes.c_void_p(graph), frm, to, data, ctypes.byref(n)), "cuGraphGetEdges_v2")
    return [(frm[i], to[i], data[i]) for i in range(n.value)]


def node_type(node: int) -> int:
    t = ctypes.c_int(-1)
    _check(_cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
    return t.value


def kernel_name(node: int) -> str:
    p = KernelNodeParams()
    _check(_cuda.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p)), "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    if p.func:
        _check(_cuda.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(p.func)), "cuFuncGetName")
    else:
        _check(_cuda.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(p.kern)), "cuKernelGetName")
    return name.value.decode()


def make_programmatic(graph: int, allow=lambda up, down: True) -> int:
    """Turn each plain kernel->kernel edge whose (upstream, downstream) kernel names `allow` accepts into a
    programmatic one; returns how many were turned."""
    turned = 0
    for frm, to, data in graph_edges(graph):
        if data.type != 0 or node_type(frm) != CU_GRAPH_NODE_TYPE_KERNEL or node_type(to) != CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        if not allow(kernel_name(frm), kernel_name(to)):
            continue
        f, t = (ctypes.c_void_p * 1)(frm), (ctypes.c_void_p * 1)(to)
        _check(_cuda.cuGraphRemoveDependencies_v2(ctypes.c_void_p(graph), f, t, (EdgeData * 1)(data), 1),
               "cuGraphRemoveDependencies_v2")
        new = EdgeData(CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, 0, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        _check(_cuda.cuGraphAddDependencies_v2(ctypes.c_void_p(graph), f, t, (EdgeData * 1)(new), 1),
               "cuGraphAddDependencies_v2")
        turned += 1
    return turned


@triton.jit
def _globaltimer(dummy):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _late_writer(x_ptr, n, value, spin_ns):
    """Lets dependents launch, spins, then fills x[:n] with value."""
    gdc_launch_dependents()
    t0 = _globaltimer(n)
    t = t0
    while t - t0 < spin_ns:
        t = _globaltimer(n)
    offs = tl.arange(0, 1024)
    fill = (tl.zeros([1024], dtype=tl.float32) + value).to(x_ptr.dtype.element_ty)
    for i in range(0, n, 1024):
        tl.store(x_ptr + i + offs, fill, mask=i + offs < n)


@triton.jit
def _reader(x_ptr, y_ptr, n, WAIT: tl.constexpr):
    if WAIT:
        gdc_wait()
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


HIDDEN, Q_DIM, QKV_DIM, INTER = 1024, 2048, 4096, 3072


def late_write_trial(x: torch.Tensor, out: torch.Tensor, reader, expect: torch.Tensor, replays: int) -> tuple:
    """Capture [_late_writer fills x with ones, reader()], turn the graph's plain kernel edges programmatic, replay:
    (replays whose `out` matches `expect`, edges turned, kernels after the writer). x and out are zeroed before
    each replay, so a reader that does not wait for the writer sees zeros."""
    reader()  # cuBLAS handles and heuristics, Triton compiles: outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        _late_writer[(1,)](x, x.numel(), 1.0, 30_000)
        reader()
    names = [kernel_name(to) for _, to, _ in graph_edges(g.raw_cuda_graph()) if node_type(to) == CU_GRAPH_NODE_TYPE_KERNEL]
    turned = make_programmatic(g.raw_cuda_graph())
    g.instantiate()
    right = 0
    for _ in range(replays):
        x.zero_()
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        right += int(torch.allclose(out.float(), expect.float(), rtol=2e-2, atol=2e-2))
    return right, turned, names


LAYER_SHAPES = (("qkv", HIDDEN, QKV_DIM, False), ("o_proj+res", Q_DIM, HIDDEN, True),
                ("gate_up", HIDDEN, 2 * INTER, False), ("down+res", INTER, HIDDEN, True))


def probe(rows: list[int]) -> None:
    dev, dt = "cuda", torch.bfloat16
    n_ctrl = 1 << 16
    for wait in (False, True):
        x, y = torch.zeros(n_ctrl, device=dev, dtype=dt), torch.zeros(n_ctrl, device=dev, dtype=dt)
        right, turned, _ = late_write_trial(x, y, lambda x=x, y=y, w=wait: _reader[(n_ctrl // 1024,)](x, y, n_ctrl,
                                                                                                     WAIT=w),
                                            torch.ones_like(y), 1)
        print(f"control: Triton reader {'with' if wait else 'without'} griddepcontrol.wait, {turned} edge "
              f"programmatic: {'the new' if right else 'stale'} input read", flush=True)
    for m in rows:
        for label, k, n, residual in LAYER_SHAPES:
            x = torch.zeros(m, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.05
            h = torch.zeros(m, n, device=dev, dtype=dt)
            y = torch.zeros(m, n, device=dev, dtype=dt)

            def gemm(x=x, w=w, h=h, y=y, residual=residual) -> None:
                if residual:
                    h.addmm_(x, w.t())  # h is zeroed before each replay: h == y's expectation
                else:
                    torch.matmul(x, w.t(), out=y)

            right, turned, names = late_write_trial(x, h if residual else y, gemm, F.linear(torch.ones_like(x), w), 5)
            print(f"M={m:3d} {label:10s}: {right}/5 replays right with {turned} programmatic edge(s); "
                  f"kernels after the writer: {', '.join(nm[:60] for nm in names)}", flush=True)


def probe_candidates(rows: list[int]) -> None:
    """The same probe over every algorithm cuBLASLt's heuristic offers per shape: which kernels wait."""
    from cublaslt_gpu import Lt, _cublaslt

    lt = Lt(_cublaslt())
    dev, dt = "cuda", torch.bfloat16
    for m in rows:
        for label, k, n, _ in LAYER_SHAPES:
            x = torch.zeros(m, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.05
            y = torch.zeros(m, n, device=dev, dtype=dt)
            expect = F.linear(torch.ones_like(x), w)
            prob = lt.problem(m, n, k)
            waiting, plain = [], []
            for i, h in enumerate(lt.heuristics(prob)):
                try:
                    right, _, names = late_write_trial(
                        x, y, lambda a=h.algo, x=x, w=w, y=y, prob=prob: lt.matmul(prob, a, x, w, y), expect, 3)
                except RuntimeError as e:
                    print(f"  M={m} {label} h{i}: {e}", flush=True)
                    continue
                (waiting if right == 3 else plain).append(f"h{i} {'+'.join(nm[:48] for nm in names)}")
            print(f"M={m:3d} {label:10s}: {len(waiting)} candidates wait, {len(plain)} do not; waiting: "
                  f"{'; '.join(waiting) or '-'} | first plain: {'; '.join(plain[:3])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,128,256")
    ap.add_argument("--sections", default="probe,candidates")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if "probe" in args.sections:
        probe(rows)
    if "candidates" in args.sections:
        probe_candidates(rows)


if __name__ == "__main__":
    main()
