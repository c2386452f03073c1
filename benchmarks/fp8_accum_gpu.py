"""cuBLASLt's tensor-scaled FP8 GEMM (kernels/fp8_rows.rows_linear_gpu) with and without fast accumulation, per
projection of a preset and row count, on this GPU: time and error.

    PYTHONPATH=. python3 benchmarks/fp8_accum_gpu.py --model qwen3-8b --rows 64 128 256 2048 16384

Hopper's FP8 MMA accumulates with a narrower sum than fp32; without fast accumulation cuBLASLt adds each run of
MMAs into fp32 registers every few K steps (more instructions), with it the whole K loop stays in the MMA's
accumulator (vLLM's per-tensor FP8 GEMMs on Hopper use CUTLASS's FP8FastAccum schedules). Per (projection, rows):
- microseconds per call of each mode inside a CUDA graph, the weight rotated over copies that exceed L2
  (decode-like: the weight from HBM);
- each mode's error against the exact product of the same FP8 operands (float64), as max |err| / rms(exact) and
  rms(err) / rms(exact), float32 output; and for scale the error FP8 quantization itself makes (the exact product
  of the quantized operands against the float product of the unquantized ones).
Activations: randn rows with 1% of columns 20x larger (outlier channels), quantized per row; weights randn * 0.02,
one scale per tensor. Prints a table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fp8_gemm_gpu import projection_shapes  # noqa: E402
from benchmarks.kernels import graph_seconds  # noqa: E402
from nvcli.kernels.block_fp8 import quantize_weight_per_tensor  # noqa: E402
from nvcli.kernels.fp8_rows import _one, quantize_rows_ref  # noqa: E402


def gemm(q: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype, fast: bool) -> torch.Tensor:
    out = torch._scaled_mm(q, wq.t(), scale_a=_one(q.device), scale_b=ws, out_dtype=out_dtype, use_fast_accum=fast)
    return out[0] if isinstance(out, tuple) else out


def time_gemm(q: torch.Tensor, wqs: list[torch.Tensor], ws: torch.Tensor, fast: bool, calls: int = 40) -> float:
    """Microseconds per bf16-output call: `calls` calls cycling over the weight copies (the weight streams from HBM),
    captured in one CUDA graph and replayed, so that the host's launch cost is not timed."""

    def run() -> None:
        for i in range(calls):
            gemm(q, wqs[i % len(wqs)], ws, torch.bfloat16, fast)

    return graph_seconds(run, warm_runs=1, replays=7, skip=2) * 1e6 / calls


def rel(err: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    rms = ref.pow(2).mean().sqrt().item()
    return err.abs().max().item() / rms, err.pow(2).mean().sqrt().item() / rms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 2048, 16384])
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"## device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    table = []
    for name, n, k in projection_shapes(args.model, args.tp):
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        wq, ws = quantize_weight_per_tensor(w)
        copies = max(1, -(-(256 << 20) // wq.numel()))  # >= 256 MB of weights: past L2
        wqs = [wq.clone() for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=gen)
            x[:, torch.randperm(k, device=dev, generator=gen)[: max(1, k // 100)]] *= 20
            q, s = quantize_rows_ref(x)
            exact = (q.double() @ wq.double().T) * ws.double()
            unquantized = (x.double() / s.double()[:, None]) @ w.double().T  # the row scale left pending
            row = {"proj": name, "n": n, "k": k, "rows": m}
            row["quant max"], row["quant rms"] = rel(exact - unquantized, unquantized)
            for fast in (False, True):
                tag = "fast" if fast else "exact"
                got = gemm(q, wq, ws, torch.float32, fast).double()
                row[f"{tag} max"], row[f"{tag} rms"] = rel(got - exact, exact)
                row[f"{tag} us"] = time_gemm(q, wqs, ws, fast)
            table.append(row)
            print(f"## {name} [{n}x{k}] {m} rows: {row['exact us']:.1f} -> {row['fast us']:.1f} us", flush=True)
            del exact, unquantized
        wqs.clear()
        torch.cuda.empty_cache()
    print("| proj [N x K] | rows | us, fp32 accum | us, fast accum | fast / fp32 | err max / rms, fp32 accum | "
          "err max / rms, fast accum | FP8 quantization's own err max / rms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['proj']} [{r['n']}x{r['k']}] | {r['rows']} | {r['exact us']:.1f} | {r['fast us']:.1f} | "
              f"{r['fast us'] / r['exact us']:.3f} | {r['exact max']:.1e} / {r['exact rms']:.1e} | "
              f"{r['fast max']:.1e} / {r['fast rms']:.1e} | {r['quant max']:.1e} / {r['quant rms']:.1e} |")


if __name__ == "__main__":
    main()
