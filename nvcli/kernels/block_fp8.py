"""Block-wise FP8 (float8_e4m3fn) in torch: the weight format, the activation quantization and the torch reference of
kernels/fp8_gemm.py.

The format is DeepSeek-V3's and Qwen3-FP8's: a weight [N, K] is stored as float8_e4m3fn with one float32 scale per
128 x 128 block, `weight_scale_inv` [ceil(N / 128), ceil(K / 128)], and the real weight is fp8 * scale (the last
row and column blocks may be partial). A block's scale is amax / 448, so its largest entry maps to +-448, e4m3's
largest finite value. Activations are quantized on the fly per token per 128 columns (scales [M, ceil(K / 128)]),
and y = sum over K blocks kb of (A[:, kb] @ B[:, kb].T) * a_scale[:, kb] * b_scale[n, kb], accumulated in float32.

A layer's scales may be kept per output row instead of per 128 rows (`scale_rows` 1, not 128): a fused layer whose
shards are not multiples of 128 rows (the k / v projections of a small model) stacks its shards' block scales row by
row, so every row keeps its own shard's scale. Nothing here imports Triton: the CPU runs it.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # rows and columns of a weight block; columns of an activation group
# floor of an activation group's amax: an all-zero group gets a tiny scale instead of a division by zero
ACT_EPS = 1e-10
# floor of a weight block's scale (an all-zero block stores zeros with this scale)
WEIGHT_EPS = 1e-12
# rows of quantized activations as the GPU GEMMs take them: padded to a multiple of this (cuBLASLt's block-scaled
# GEMM needs it), the padding rows zeros
M_ALIGN = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_weight(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale_inv float32 [ceil(N / block), ceil(K / block)]): per block scale = amax / 448,
    fp8 = clamp(w / scale) rounded to nearest."""
    n, k = w.shape
    nb, kb = _cdiv(n, block), _cdiv(k, block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, block, kb, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=WEIGHT_EPS)  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def quantize_weight_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale float32 [1]): scale = max(amax, 1e-12) / 448, fp8 = clamp(w / scale)."""
    wf = w.float()
    amax = wf.abs().amax() if wf.numel() else torch.zeros((), device=w.device)
    scale = (amax.clamp(min=WEIGHT_EPS) / torch.full_like(amax, FP8_MAX)).reshape(1)
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def expand_scale(scale: torch.Tensor, n: int, k: int, scale_rows: int = BLOCK) -> torch.Tensor:
    """Scales [ceil(N / scale_rows), ceil(K / 128)] as one float32 value per weight entry [N, K]."""
    return scale.repeat_interleave(scale_rows, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      scale_rows: int = BLOCK) -> torch.Tensor:
    """fp8 [N, K] times its scales ([ceil(N / scale_rows), ceil(K / 128)]) -> [N, K] in `dtype` (float32 product)."""
    n, k = q.shape
    return (q.float() * expand_scale(scale.float(), n, k, scale_rows)).to(dtype)


def quantize_activations_ref(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scales float32 [M, ceil(K / group)]): per row and `group` columns scale = amax / 448
    (amax at least ACT_EPS), fp8 = clamp(x / scale)."""
    m, k = x.shape
    kb = _cdiv(k, group)
    padded = torch.zeros(m, kb * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, kb, group)
    scale = groups.abs().amax(dim=2).clamp(min=ACT_EPS) / FP8_MAX  # [M, kb]
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * group)[:, :k].contiguous(), scale


def block_fp8_matmul_ref(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                         scale_rows: int = BLOCK) -> torch.Tensor:
    """sum over K blocks of (a[:, kb] @ b[:, kb].T) * a_scale[:, kb] * b_scale[n // scale_rows, kb], float32 [M, N]:
    a fp8 [M, K] with a_scale [M, ceil(K / 128)], b fp8 [N, K] with b_scale [ceil(N / scale_rows), ceil(K / 128)]."""
    m, k = a.shape
    n = b.shape[0]
    b_rows = b_scale.float().repeat_interleave(scale_rows, 0)[:n]  # [N, kb]
    out = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb in range(_cdiv(k, BLOCK)):
        cols = slice(kb * BLOCK, min(k, (kb + 1) * BLOCK))
        out += (a[:, cols].float() @ b[:, cols].float().T) * a_scale[:, kb, None].float() * b_rows[None, :, kb]
    return out


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   scale_rows: int = BLOCK) -> torch.Tensor:
    """What kernels/fp8_gemm.fp8_linear_gpu computes: x [..., K] quantized per token per 128 columns, times the
    fp8 weight [N, K] with its block scales, plus bias, in x's dtype -> [..., N]."""
    k = x.shape[-1]
    a, a_scale = quantize_activations_ref(x.reshape(-1, k))
    y = block_fp8_matmul_ref(a, a_scale, weight, scale, scale_rows)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether `device` runs the FP8 GEMM: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper and later have
    FP8 tensor cores); elsewhere FP8 weights are dequantized once at load."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
