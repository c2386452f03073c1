"""What the rotary step folded into decode attention costs, and which part of it (H100, session 16).

    cd benchmarks && PYTHONPATH=..:. python3 rope_store_gpu.py [--fp8]   (--fp8: the fp8 half only)

The engine's decode kernel at the workload's shapes (longest first, as the engine launches it), median of
do_bench, two rounds:
- bf16 (16-token pages): without and with the rotary step;
- fp8 (32-token pages, V dims-major): without the rotary step, with it, with it but no K/V store (slot -1), and
  with the stores sent to a page that no sequence reads (every row into the table's padding block).
The two halves ran as two scripts in session 16's calls 3 and 4 and were put in one file afterwards, same launches
and shapes.
"""

from __future__ import annotations

import functools
import sys

import torch
from decode_variants import decode_rope_inputs, engine_decode_step, workload_lens
from kernels import paged_kv
from read_bw_gpu import ms

from nvcli.kernels.decode_attention import DecodeRope, paged_decode_attention_triton
from nvcli.models.layers.rotary import RotaryEmbedding

DEV = "cuda"


def time_variants(label: str, call: functools.partial, variants: list[tuple[str, dict]], kv_bytes: int) -> None:
    """Each variant's keyword arguments added to `call`, in turn, two rounds: us per call and TB/s of KV."""
    for _ in range(2):
        for name, kw in variants:
            t = ms(functools.partial(call, **kw))
            print(f"{label} {name}: {t * 1e3:.1f} us, {kv_bytes / t / 1e9:.3f} TB/s", flush=True)


def bf16_rows(cos_sin: torch.Tensor, w: torch.Tensor) -> None:
    for num_seqs, step, seed in [(256, 300, 1), (128, 500, 2), (64, 800, 3)]:
        lens = workload_lens(num_seqs, step, seed)
        k, v, bt = paged_kv(lens, 8, 128, 16, torch.bfloat16, DEV)
        sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
        q, rope = decode_rope_inputs(sl, bt, 16, DEV, cos_sin, w)
        time_variants(f"bf16 {num_seqs} x ~{sum(lens) // num_seqs}",
                      functools.partial(paged_decode_attention_triton, q, k, v, bt, sl, 128**-0.5, order=order),
                      [("no rotary", {}), ("rotary", {"rope": rope})], 2 * sum(lens) * 8 * 128 * 2)


def fp8_rows(cos_sin: torch.Tensor, w: torch.Tensor) -> None:
    scales = torch.tensor([0.02], device=DEV), torch.tensor([0.02], device=DEV)
    for num_seqs, step, seed in [(256, 300, 1), (128, 500, 2)]:
        lens = workload_lens(num_seqs, step, seed)
        sl, kc, vc, bt, q, rope = engine_decode_step(lens, DEV, cos_sin, w)
        order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
        pad = int(bt[0, -1])
        print("pad block unused by reads:", pad, all(int(bt[i, (n - 1) // 32]) != pad for i, n in enumerate(lens)))
        last = rope.positions
        none = DecodeRope(rope.k, rope.v, last, cos_sin, torch.full_like(rope.slot_mapping, -1), w, w, 1e-6)
        away = DecodeRope(rope.k, rope.v, last, cos_sin, pad * 32 + last % 32, w, w, 1e-6)
        time_variants(f"fp8 {num_seqs} x ~{sum(lens) // num_seqs}",
                      functools.partial(paged_decode_attention_triton, q, kc, vc, bt, sl, 128**-0.5, *scales,
                                        order=order),
                      [("no rotary", {}), ("rotary", {"rope": rope}), ("rotary, no stores", {"rope": none}),
                       ("rotary, stores into an unread page", {"rope": away})], 2 * sum(lens) * 8 * 128)


def main() -> None:
    cos_sin = RotaryEmbedding(128, 4096, 1e6, None).cos_sin_cache.to(DEV)
    w = torch.ones(128, device=DEV, dtype=torch.bfloat16)
    if "--fp8" not in sys.argv:
        bf16_rows(cos_sin, w)
    fp8_rows(cos_sin, w)


if __name__ == "__main__":
    main()
