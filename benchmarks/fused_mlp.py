"""One token's MLP, 28 layers of Qwen3-0.6B in a CUDA graph: the unfused pair (norm+gate_up GEMM, SiLU+down
GEMM, chained with PDL) against the one-launch fused kernel (nvcli/kernels/fused_mlp.py) at several configs.

    PYTHONPATH=. python3 benchmarks/fused_mlp.py

Every layer has its own weights (19 MB each, 530 MB in all: nothing stays in L2 from one replay to the
next), the graph is replayed 50 times after a warm-up, and the median replay is divided by 28.
"""

from __future__ import annotations

import torch
from kernels import graph_seconds

from nvcli.kernels.fused_mlp import MlpConfig, fused_mlp_triton
from nvcli.kernels.skinny_gemm import norm_linear, silu_mul_linear

LAYERS, H, INTER, EPS = 28, 1024, 3072, 1e-6


def time_graph(step, x0: torch.Tensor, r0: torch.Tensor) -> float:
    """Median µs per layer of a graph of LAYERS calls of `step`."""

    def run() -> None:
        x, r = x0, r0
        for layer in range(LAYERS):
            x, r = step(layer, x, r)

    return graph_seconds(run, warm_runs=2, replays=60, skip=10) * 1e6 / LAYERS


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w_gu = [torch.randn(2 * INTER, H, device=dev, generator=gen, dtype=torch.bfloat16) * H**-0.5 for _ in range(LAYERS)]
    w_dn = [torch.randn(H, INTER, device=dev, generator=gen, dtype=torch.bfloat16) * INTER**-0.5 for _ in range(LAYERS)]
    nw = [torch.ones(H, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    x0 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    r0 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)

    def unfused(layer: int, x: torch.Tensor, r: torch.Tensor):
        gate_up, r = norm_linear(x, r, nw[layer], EPS, w_gu[layer])
        return silu_mul_linear(gate_up, w_dn[layer]), r

    floor = (2 * INTER * H + H * INTER) * 2 / 3.0e6  # µs per layer at 3.0 TB/s
    print(f"weight floor at 3.0 TB/s: {floor:.1f} us/layer")
    print(f"unfused (2 kernels, PDL)       {time_graph(unfused, x0, r0):6.1f} us/layer")
    configs = [MlpConfig()] + [
        MlpConfig(block_r=br, block_k1=k1, block_n=bn, block_k2=k2, num_warps=w)
        for w in (4, 8, 16)
        for br, k1 in ((8, 512), (8, 1024), (16, 512), (4, 1024))
        for bn, k2 in ((8, 1024),)
    ] + [MlpConfig(block_r=8, block_k1=1024, block_n=4, block_k2=k2, num_warps=w) for w in (8, 16) for k2 in (1024, 2048)]
    for cfg in configs:
        def fused(layer: int, x: torch.Tensor, r: torch.Tensor, cfg: MlpConfig = cfg):
            return fused_mlp_triton(x, r, nw[layer], EPS, w_gu[layer], w_dn[layer], config=cfg)

        try:
            us = time_graph(fused, x0, r0)
        except Exception as e:  # noqa: BLE001 - an infeasible config (registers, shared memory)
            print(f"fused {cfg}: failed ({type(e).__name__})")
            continue
        print(f"fused {cfg}: {us:6.1f} us/layer")


if __name__ == "__main__":
    main()
