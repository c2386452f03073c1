"""The FP8 GEMMs against each other and bf16 cuBLAS, per weight shape and row bucket, on this GPU: the measurement
behind kernels/fp8_gemm.py's choice of cuBLASLt's block-scaled GEMM wherever it runs.

    PYTHONPATH=. python3 benchmarks/fp8_gemm_gpu.py --model qwen3-8b qwen3-30b-a3b --tp 1 2   # H100: ~2 minutes
    PYTHONPATH=. python3 benchmarks/fp8_gemm_gpu.py --smoke                                    # CPU: TRITON_INTERPRET=1

For each projection of the preset (qkv, o, gate_up, down; a mixture-of-experts model's attention projections only: its
experts run kernels/fused_moe.py) at each tensor-parallel size, and each row bucket (16 ... 4096 rows, timed at the
bucket's largest M), times with L2 flushed between calls (triton.testing.do_bench):
- the Triton kernel in every candidate tile (BLOCK_M, BLOCK_N, warps, stages) that fits the bucket,
- cuBLASLt's block-scaled FP8 GEMM (torch scaled_mm) where this torch / CUDA build has it,
- for scale, bf16 cuBLAS (F.linear) and the Triton kernel's own tile (choose_config), and the activation quantization kernel
  that precedes either GEMM.
Prints a table last: microseconds per call, and the fastest per (shape, bucket).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nvcli.kernels.fp8_gemm import (  # noqa: E402
    Fp8GemmConfig,
    _cublas_mm,
    choose_config,
    cublas_eligible,
    cublas_supported,
    cublas_weight_scales,
    fp8_matmul_triton,
    quantize_activations_triton,
)

BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def projection_shapes(preset: str, tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of the preset's FP8 projections on one rank of `tp`."""
    from nvcli.models.presets import PRESETS

    c = PRESETS[preset]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    heads, kv = c["num_attention_heads"] // tp, max(1, c["num_key_value_heads"] // tp)
    shapes = [("qkv", (heads + 2 * kv) * head_dim, c["hidden_size"]), ("o", c["hidden_size"], heads * head_dim)]
    if not c.get("num_experts"):
        inter = c["intermediate_size"] // tp
        shapes += [("gate_up", 2 * inter, c["hidden_size"]), ("down", c["hidden_size"], inter)]
    return shapes


def candidates(bucket: int) -> list[Fp8GemmConfig]:
    if bucket <= 64:
        return [Fp8GemmConfig(bm, bn, 4, st) for bm in (16, 32, 64) if bm <= bucket
                for bn in (32, 64, 128) for st in (3, 4, 5)]
    return [Fp8GemmConfig(bm, bn, w, st) for bm in (64, 128) for bn in (64, 128, 256)
            for w in ((4,) if bm == 64 else (4, 8)) for st in (3, 4, 5)]


def time_us(fn, smoke: bool) -> float:
    if smoke:
        fn()
        return 0.0
    import triton.testing

    return triton.testing.do_bench(fn, warmup=3, rep=15, return_mode="median") * 1e3


def triton_call(a, a_s, wq, ws, out, m: int, cfg: Fp8GemmConfig):
    return lambda: fp8_matmul_triton(a[:m], a_s[:m], wq, ws, out, None, 128, cfg)


def measure(model: str, name: str, tp: int, wq: torch.Tensor, ws: torch.Tensor, w16: torch.Tensor,
            scale_mm: torch.Tensor | None, bucket: int, sms: int, gen: torch.Generator, smoke: bool
            ) -> tuple:
    """The table row of `bucket` rows against the weight: every GEMM's time and the fastest."""
    (n, k), m, dtype = wq.shape, bucket, w16.dtype
    x = torch.randn(m, k, device=wq.device, generator=gen).to(dtype)
    a, a_s = quantize_activations_triton(x, m_major=True)
    out = torch.empty(m, n, dtype=dtype, device=wq.device)
    quant = time_us(lambda: quantize_activations_triton(x, m_major=True), smoke)
    bf16 = time_us(lambda: torch.nn.functional.linear(x, w16), smoke)
    heur = choose_config(m, n, sms)
    results: dict[Fp8GemmConfig, float] = {}
    for cfg in candidates(bucket)[: 2 if smoke else None]:
        try:
            results[cfg] = time_us(triton_call(a, a_s, wq, ws, out, m, cfg), smoke)
        except Exception as e:  # a tile that does not fit this GPU's shared memory
            print(f"  skip {cfg}: {type(e).__name__}", flush=True)
    heur_t = results[heur] if heur in results else time_us(triton_call(a, a_s, wq, ws, out, m, heur), smoke)
    best_cfg = min(results, key=results.__getitem__)
    best = results[best_cfg]
    choice = f"{best_cfg.block_m}x{best_cfg.block_n} w{best_cfg.num_warps} s{best_cfg.num_stages}"
    cub = float("nan")
    if scale_mm is not None:
        cub = time_us(lambda: _cublas_mm(a, a_s, wq, scale_mm, 128, dtype), smoke)
        if cub < best:
            best, choice = cub, "cublas"
    print(f"{model} tp{tp} {name} [{n}x{k}] M={bucket}: bf16 {bf16:.1f} heuristic {heur_t:.1f} best {best:.1f} "
          f"({choice}) cublas {cub:.1f} quant {quant:.1f} us", flush=True)
    return (f"{model}/tp{tp}", name, n, k, bucket, bf16, heur_t, best, cub, quant, choice)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["qwen3-8b"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, two buckets, no timing (CPU)")
    args = ap.parse_args()

    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        shapes = [("tiny", "qkv", 1, 256, 256)]
        buckets: tuple[int, ...] = (16, 128)
    else:
        shapes = [(m, name, tp, n, k) for m in args.model for tp in args.tp for name, n, k in projection_shapes(m, tp)]
        buckets = BUCKETS
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cublas = cublas_supported(device, dtype, 128)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; cuBLASLt block-scaled: "
          f"{cublas}", flush=True)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132

    rows = []
    done: set[tuple[int, int]] = set()
    for model, name, tp, n, k in shapes:
        if (n, k) in done:
            continue
        done.add((n, k))
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, device=device, generator=gen) * 0.02
        from nvcli.kernels.block_fp8 import quantize_weight

        wq, ws = quantize_weight(w)
        scale_mm = cublas_weight_scales(ws, 128) if cublas and cublas_eligible(n, k, 128) else None
        w16 = w.to(dtype)
        for bucket in buckets:
            rows.append(measure(model, name, tp, wq, ws, w16, scale_mm, bucket, sms, gen, args.smoke))

    print("\n| model | proj | N x K | M | bf16 us | fp8 Triton (own tile) | fp8 fastest | cuBLAS fp8 | act quant | best/bf16 | choice |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model, proj, n, k, m, bf16, heur_t, best, cub, quant, choice in rows:
        ratio = (best + quant) / bf16 if bf16 else float("nan")
        print(f"| {model} | {proj} | {n}x{k} | {m} | {bf16:.1f} | {heur_t:.1f} | {best:.1f} | {cub:.1f} | {quant:.1f} "
              f"| {ratio:.2f} | {choice} |")


if __name__ == "__main__":
    main()
