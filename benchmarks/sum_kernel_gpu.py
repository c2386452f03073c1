"""How fast the deferred sum's one-shot kernel (kernels/allreduce_norm.py) reads its peers' shares, and what its
barrier costs: the lead the decision log names for tensor-parallel decode sums. One process per GPU; each variant is
timed inside a CUDA graph of `--iters` calls (allreduce_gpu._graph_time_us), on the engine's deferred-sum buffers.

Variants, per rows x hidden bf16 share:
- `engine`: the barrier, then the sum+add+RMSNorm kernel, as the engine runs them (distributed.sum_add_norm);
- `kernel wN`: the kernel alone, no barrier, at N warps a row (the engine's is 8 from 1,024 columns);
- `local wN`: the same kernel with every share this rank's own (no NVLink): what the peer reads add;
- `barrier`: the barrier alone.

    PYTHONPATH=. python3 benchmarks/sum_kernel_gpu.py --tp 2 --hidden 4096 --rows 64 128 256
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from allreduce_gpu import _graph_time_us  # noqa: E402


def _launch(parts, residual, weight, warps: int):
    import triton

    from nvcli.kernels.allreduce_norm import MAX_WORLD, _sum_add_norm_kernel

    first = parts[0]
    rows, n = first.shape
    out = torch.empty_like(first)
    new_res = torch.empty_like(first)
    ptrs = list(parts) + [first] * (MAX_WORLD - len(parts))
    _sum_add_norm_kernel[(rows,)](*ptrs, residual, weight, out, new_res, 1e-6, N=n, BLOCK=triton.next_power_of_2(n),
                                  WORLD=len(parts), HAS_RES=True, NORM=True, num_warps=warps)
    return out


def _worker(rank: int, world: int, port: int, args, out: dict) -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                            device_id=device)
    from nvcli import distributed

    hidden = args.hidden
    assert distributed.init_deferred_sums(max(args.rows) * hidden, torch.bfloat16, device), "no deferred sums"
    weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    results: dict[str, float] = {}
    for r in args.rows:
        residual = torch.randn(r, hidden, dtype=torch.bfloat16, device=device)
        p = distributed.partial_target(r, hidden, torch.bfloat16, device)
        p.local.normal_()
        torch.cuda.synchronize()
        dist.barrier()
        results[f"engine rows={r}"] = _graph_time_us(
            lambda p=p, residual=residual: distributed.sum_add_norm(p, residual, weight, 1e-6), args.iters)
        results[f"barrier rows={r}"] = _graph_time_us(lambda p=p: p.handle.barrier(channel=0), args.iters)
        own = [p.local] * world
        for warps in args.warps:
            results[f"kernel w{warps} rows={r}"] = _graph_time_us(
                lambda p=p, residual=residual, warps=warps: _launch(p.parts, residual, weight, warps), args.iters)
            results[f"local w{warps} rows={r}"] = _graph_time_us(
                lambda own=own, residual=residual, warps=warps: _launch(own, residual, weight, warps), args.iters)
        dist.barrier()
    if rank == 0:
        out.update(results)
    distributed.release_deferred_sums()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(args.tp, port, args, out), nprocs=args.tp)
    names = sorted({k.split(" rows=")[0] for k in out})
    print(f"TP {args.tp}, rows x {args.hidden} bf16, us per call (CUDA graph of {args.iters})")
    print("| variant | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("| --- |" + " --- |" * len(args.rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{out[f'{name} rows={r}']:.1f}" for r in args.rows) + " |")


if __name__ == "__main__":
    main()
