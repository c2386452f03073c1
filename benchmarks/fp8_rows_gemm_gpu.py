"""The row-scaled FP8 decode GEMM (kernels/fp8_rows.py): cuBLASLt's tensor-scaled GEMM (torch._scaled_mm, what
decode steps run) against the Triton kernel `rows_linear_triton` in every candidate tile, and bf16 cuBLAS for scale,
per projection of a preset and decode row count, L2 flushed between calls (triton.testing.do_bench).

    PYTHONPATH=. python3 benchmarks/fp8_rows_gemm_gpu.py --model qwen3-8b      # H100 / H200: ~3 minutes
    PYTHONPATH=. python3 benchmarks/fp8_rows_gemm_gpu.py --smoke               # CPU: TRITON_INTERPRET=1

Prints per (projection, rows) the times and the fastest tile, then per row count the decode step's projections
summed over the layers (cuBLASLt against the fastest of the two per projection), and the table last.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fp8_gemm_gpu import projection_shapes, time_us  # noqa: E402

from nvcli.kernels.block_fp8 import quantize_weight_per_tensor  # noqa: E402
from nvcli.kernels.fp8_rows import quantize_rows_triton, rows_linear_gpu, rows_linear_triton  # noqa: E402

ROWS = (1, 8, 16, 32, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


def tiles(m: int) -> list[Tile]:
    top = max(16, 1 << (m - 1).bit_length())
    bms = [bm for bm in (16, 32, 64, 128, 256) if bm <= top and bm * 4 >= top and not (bm == 256 and m < 256)]
    out = []
    for bm in bms:
        for bn in (32, 64, 128):
            if bm * bn > 128 * 128:
                continue
            for bk in (128, 256):
                for w in ((4,) if bm * bn <= 64 * 64 else (4, 8)):
                    for st in (3, 5):
                        out.append(Tile(bm, bn, bk, w, st))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["qwen3-8b"])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--smoke", action="store_true", help="one tiny shape, two row counts, two tiles, no timing (CPU)")
    args = ap.parse_args()
    from nvcli.models.presets import PRESETS

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        shapes, rows, layers = [("tiny", "qkv", 256, 256)], [1, 33], {"tiny": 1}
    else:
        shapes = [(m, name, n, k) for m in args.model for name, n, k in projection_shapes(m, 1)]
        rows, layers = args.rows, {m: PRESETS[m]["num_hidden_layers"] for m in args.model}
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)
    table = []
    for model, name, n, k in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        wq, ws = quantize_weight_per_tensor(torch.randn(n, k, device=device, generator=gen) * 0.02)
        w16 = torch.randn(n, k, device=device, generator=gen).to(dtype)
        for m in rows:
            x = torch.randn(m, k, device=device, generator=gen).to(dtype)
            q, _ = quantize_rows_triton(x)
            want = rows_linear_gpu(q, wq, ws, dtype) if not args.smoke else None
            cub = time_us(lambda q=q, wq=wq, ws=ws: rows_linear_gpu(q, wq, ws, dtype), args.smoke) if not args.smoke else 0.0
            bf16 = time_us(lambda x=x, w16=w16: torch.nn.functional.linear(x, w16), args.smoke)
            best, best_t = None, float("inf")
            for t in tiles(m)[: 2 if args.smoke else None]:
                call = lambda t=t, q=q, wq=wq, ws=ws: rows_linear_triton(q, wq, ws, dtype, t.block_m, t.block_n, t.block_k,  # noqa: E731
                                                                          t.num_warps, t.num_stages)
                try:
                    got = call()
                    if want is not None and not torch.allclose(got.float(), want.float(), rtol=2e-2,
                                                               atol=1e-2 * want.float().abs().max().item()):
                        print(f"  WRONG {t}", flush=True)
                        continue
                    us = time_us(call, args.smoke)
                except Exception as e:  # a tile over this GPU's shared memory
                    print(f"  skip {t}: {type(e).__name__}", flush=True)
                    continue
                if us < best_t:
                    best, best_t = t, us
            print(f"{model} {name} [{n}x{k}] M={m}: bf16 {bf16:.1f} cublas {cub:.1f} triton {best_t:.1f} ({best}) us",
                  flush=True)
            table.append((model, name, n, k, m, bf16, cub, best_t, best))
    print("\n| model | proj | N x K | M | bf16 us | cuBLASLt fp8 us | Triton fp8 us | tile | Triton / cuBLASLt |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, name, n, k, m, bf16, cub, tri, t in table:
        print(f"| {model} | {name} | {n}x{k} | {m} | {bf16:.1f} | {cub:.1f} | {tri:.1f} | {t} | "
              f"{tri / cub if cub else float('nan'):.2f} |")
    print("\n| model | M | step's projections, cuBLASLt ms | fastest of the two per projection, ms | bf16 ms |")
    print("|---|---|---|---|---|")
    for model in layers:
        for m in rows:
            mine = [r for r in table if r[0] == model and r[4] == m]
            cub = sum(r[6] for r in mine) * layers[model] / 1e3
            fast = sum(min(r[6], r[7]) for r in mine) * layers[model] / 1e3
            bf16 = sum(r[5] for r in mine) * layers[model] / 1e3
            print(f"| {model} | {m} | {cub:.3f} | {fast:.3f} | {bf16:.3f} |")


if __name__ == "__main__":
    main()
