"""All-reduce latency at tensor parallelism's decode sizes: NCCL (eager and inside a CUDA graph, as the engine runs
it) against torch's symmetric-memory one-shot and two-shot all-reduce through peer-mapped buffers (vLLM's custom
all-reduce idea). One process per GPU; each op is timed as the mean of `--iters` ops replayed from one CUDA graph.

    PYTHONPATH=. python3 benchmarks/allreduce_gpu.py --tp 2 [--hidden 4096] [--rows 1,8,32,128,256,512]

Also the engine's two paths for a row-parallel projection's sum and the add+RMSNorm after it (_engine_paths).

Prints `## <method> rows=<R>: <us> us` rows and a table.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _graph_time_us(fn, iters: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 5
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * iters)


def _worker(rank: int, world: int, port: int, hidden: int, rows: list[int], iters: int, out: dict) -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # the lent machines keep multicast off
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                            device_id=torch.device("cuda", rank))
    results: dict[str, float] = {}
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(max(rows) * hidden, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        symm = (buf, dist.group.WORLD.group_name)
    except Exception as e:  # noqa: BLE001 - reported, NCCL still measured
        if rank == 0:
            print(f"symmetric memory unavailable: {type(e).__name__}: {e}", flush=True)
    for r in rows:
        x = torch.randn(r, hidden, dtype=torch.bfloat16, device="cuda")
        results[f"nccl-graph rows={r}"] = _graph_time_us(lambda x=x: dist.all_reduce(x), iters)
        if symm is not None:
            buf, name = symm
            view = buf[: r * hidden].view(r, hidden)
            for method in ("one_shot", "two_shot"):
                try:
                    if method == "one_shot":
                        def op(view=view, name=name):
                            return torch.ops.symm_mem.one_shot_all_reduce(view, "sum", name)
                    else:
                        def op(view=view, name=name):
                            return torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", name)
                    results[f"symm-{method} rows={r}"] = _graph_time_us(op, iters)
                except Exception as e:  # noqa: BLE001
                    if rank == 0:
                        print(f"symm {method} rows={r} failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                              flush=True)
    results.update(_engine_paths(rank, hidden, rows, iters))
    if rank == 0:
        out.update(results)
    dist.barrier()
    dist.destroy_process_group()


def _engine_paths(rank: int, hidden: int, rows: list[int], iters: int) -> dict[str, float]:
    """A row-parallel projection's sum and the add+RMSNorm after it, as the engine can run them:
    - `engine-two-shot+norm`: copy into the symmetric buffer, torch's two-shot all-reduce, copy out, add+RMSNorm;
    - `in-place+norm` (the engine's path from TP 3 on past the deferred rows): the GEMM wrote the symmetric buffer;
      the two-shot runs there in place and the sum+add+RMSNorm kernel reads the sum from it;
    - `deferred+norm`: the GEMM wrote a deferred-sum buffer; a barrier and the fused one-shot sum+add+RMSNorm kernel
      (distributed.sum_add_norm)."""
    from nvcli import distributed
    from nvcli.kernels.rms_norm import rms_norm_triton

    results: dict[str, float] = {}
    device = torch.device("cuda", rank)
    if not distributed.init_symmetric_all_reduce(max(rows) * hidden, torch.bfloat16, device):
        return results
    deferred = distributed.init_deferred_sums(max(rows) * hidden, torch.bfloat16, device)
    weight = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    try:
        for r in rows:
            x = torch.randn(r, hidden, dtype=torch.bfloat16, device="cuda")
            residual = torch.randn(r, hidden, dtype=torch.bfloat16, device="cuda")
            results[f"engine-two-shot+norm rows={r}"] = _graph_time_us(
                lambda x=x, residual=residual: rms_norm_triton(distributed.all_reduce(x), weight, 1e-6, residual),
                iters)
            view = distributed.reduce_target(r, hidden, torch.bfloat16, device)
            if view is not None:
                results[f"in-place+norm rows={r}"] = _graph_time_us(
                    lambda view=view, residual=residual: distributed.sum_add_norm(
                        distributed.summed_in_place(view), residual, weight, 1e-6), iters)
            if deferred:
                def op(r=r, residual=residual):
                    p = distributed.partial_target(r, hidden, torch.bfloat16, device)
                    return distributed.sum_add_norm(p, residual, weight, 1e-6)
                distributed.begin_forward()
                results[f"deferred+norm rows={r}"] = _graph_time_us(op, iters)
                distributed.end_forward()
    finally:
        distributed.release_deferred_sums()
        distributed.release_symmetric_all_reduce()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,8,32,128,256,512")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(args.tp, port, args.hidden, rows, args.iters, out), nprocs=args.tp)
    print(f"| method | rows x {args.hidden} bf16 | us per all-reduce (TP={args.tp}) |")
    print("| --- | --- | --- |")
    for key, us in sorted(out.items(), key=lambda kv: (kv[0].split()[0], int(kv[0].split("=")[1]))):
        method, r = key.split()
        print(f"## {method} {r}: {us:.1f} us")
    for key, us in sorted(out.items(), key=lambda kv: (int(kv[0].split("=")[1]), kv[0])):
        method, r = key.split()
        print(f"| {method} | {r.split('=')[1]} | {us:.1f} |")


if __name__ == "__main__":
    main()
