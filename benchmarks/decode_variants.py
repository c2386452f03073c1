"""Decode attention at the workload's shapes, code variants side by side (CUDA events, median).

    PYTHONPATH=. python3 benchmarks/decode_variants.py            # timing table
    PYTHONPATH=. python3 benchmarks/decode_variants.py --layouts  # fp8 page layouts, decode and prefill
    PYTHONPATH=. python3 benchmarks/decode_variants.py --dims-major-sweep  # tile knobs of the dims-major loop;
                                                                # bf16 with 16- and 32-token pages
    PYTHONPATH=. python3 benchmarks/decode_variants.py --order-rope  # fp8 default kernel with the rotary step:
                                                                # its cost, L2 prefetch before it, program order
    PYTHONPATH=. python3 benchmarks/decode_variants.py --split-sweep  # fp8 at the batches that take KV splits
    PYTHONPATH=. python3 benchmarks/decode_variants.py --prefill-sweep  # prefill attention tile knobs, bf16 and
                                                                # fp8, at the workload's 16k-token prompt step
    PYTHONPATH=. python3 benchmarks/decode_variants.py --once     # one launch per variant, for a profiler:
    ncu --clock-control none -k regex:_decode_split --csv --page details python3 benchmarks/decode_variants.py --once

Variants are the kernel's keyword knobs: `run_addressing` (K/V addresses per run of tokens that share a page,
not per token) and `v_dequant_in_tile` (fp8: V converted to fp16 where it is loaded, so the PV dot reads it with
ldmatrix instead of one byte per shared-memory load), plus tile shapes. Bandwidth is against a device-to-device
copy measured in the same run; `err` is the largest difference from the first variant of the same cache dtype.

`--layouts` times the fp8 KV page layouts (kv_layout.py) on the same values: 16-token token-major pages (the
default before session 9), 32-token token-major pages, and 32-token pages with V dims-major (the default now),
with each layout's default kernel knobs, for decode at the shapes above and for prefill attention at a
16k-token prompt step; `err` against the first layout (the same logical cache: a 32-token page is two 16-token
pages).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernels as kb  # noqa: E402

from nvcli.kernels.decode_attention import paged_decode_attention_triton  # noqa: E402
from nvcli.kernels.kv_layout import page_view  # noqa: E402
from nvcli.kernels.prefill_attention import paged_prefill_attention_triton  # noqa: E402

SHAPES = [("B=256 ctx=800", [800] * 256), ("B=128 ctx=1200", [1200] * 128), ("B=64 ctx=1400", [1400] * 64),
          ("B=256 ctx 100-2000", [100 + (1900 * i) // 255 for i in range(256)]), ("B=16 ctx=1600", [1600] * 16)]
# (label, fp8, kernel keyword overrides)
VARIANTS = [
    ("bf16 per-token", False, dict(run_addressing=False)),
    ("bf16 runs", False, dict(run_addressing=True)),
    ("bf16 runs 3 stages", False, dict(run_addressing=True, num_stages=3)),
    ("fp8 per-token", True, dict(run_addressing=False, v_dequant_in_tile=False)),
    ("fp8 per-token V tile", True, dict(run_addressing=False, v_dequant_in_tile=True)),
    ("fp8 runs", True, dict(run_addressing=True, v_dequant_in_tile=False)),
    ("fp8 runs V tile", True, dict(run_addressing=True, v_dequant_in_tile=True)),
    ("fp8 runs V tile 2 st", True, dict(run_addressing=True, v_dequant_in_tile=True, num_stages=2)),
    ("fp8 runs V tile 4 st", True, dict(run_addressing=True, v_dequant_in_tile=True, num_stages=4)),
    ("fp8 runs V tile 128", True, dict(run_addressing=True, v_dequant_in_tile=True, block_n=128, num_stages=2)),
    # more programs per SM (compiled for sm_90a: 2 warps x 32 tokens 166 registers, 6 programs per SM)
    ("fp8 runs V tile w2 n32", True, dict(run_addressing=True, v_dequant_in_tile=True, num_warps=2, block_n=32)),
    ("fp8 runs V tile w2 n32 4 st", True, dict(run_addressing=True, v_dequant_in_tile=True, num_warps=2, block_n=32,
                                               num_stages=4)),
    ("fp8 runs V tile w4 n32 4 st", True, dict(run_addressing=True, v_dequant_in_tile=True, block_n=32, num_stages=4)),
    ("fp8 runs V tile w8 n128", True, dict(run_addressing=True, v_dequant_in_tile=True, num_warps=8, block_n=128)),
]


def as_16_token_pages(k32: torch.Tensor, v32: torch.Tensor, bt32: torch.Tensor):
    """The same logical cache on 16-token pages: each 32-token page is two (views, no copy)."""
    bt16 = torch.stack([2 * bt32, 2 * bt32 + 1], dim=2).reshape(bt32.shape[0], -1).contiguous()
    return k32.view(-1, 16, 8, 128), v32.view(-1, 16, 8, 128), bt16


def heads_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same values with each page stored [head, token, dim]."""
    nb, bs, h, d = cache.shape
    out = torch.empty(nb, h, bs, d, dtype=cache.dtype, device=cache.device).permute(0, 2, 1, 3)
    return out.copy_(cache)


def fp8_token_major(lens: list[int], dev: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_cache, v_cache, block_tables: random fp8 values on 32-token token-major pages (8 KV heads of 128)."""
    k32, v32, bt32 = kb.paged_kv(lens, 8, 128, 32, torch.bfloat16, dev, table_width=128)
    return kb.quantize(k32, 0.02)[0], kb.quantize(v32, 0.02)[0], bt32


def dims_major_copy(v32: torch.Tensor) -> torch.Tensor:
    """The same V values with each 32-token page stored dims-major (kv_layout.py)."""
    return page_view(torch.empty(v32.shape[0], 32 * 8 * 128, dtype=v32.dtype, device=v32.device), 32, 8, 128,
                     dims_major=True).copy_(v32)


def engine_fp8_cache(lens: list[int], dev: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_cache, v_cache, block_tables in the engine's default fp8 layout (32-token pages, V dims-major); the values
    of fp8_layouts' third layout, without building the other three."""
    k32, v32, bt32 = fp8_token_major(lens, dev)
    return k32, dims_major_copy(v32), bt32


def fp8_layouts(lens: list[int], dev: str) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(label, k_cache, v_cache, block_tables) of one logical fp8 cache in each page layout."""
    k32, v32, bt32 = fp8_token_major(lens, dev)
    v32_dm = dims_major_copy(v32)
    return [("16-token pages", *as_16_token_pages(k32, v32, bt32)), ("32-token pages", k32, v32, bt32),
            ("32-token pages, V dims-major", k32, v32_dm, bt32),
            ("32-token pages, V dims-major, K heads-major", heads_major_copy(k32), v32_dm, bt32)]


def timed(call: functools.partial, base: torch.Tensor | None) -> tuple[float, torch.Tensor, float]:
    """(seconds per call, output, max |output - base|; base None: this output is the base)."""
    out = call()
    base = out if base is None else base
    return kb.bench(call, True), base, (out.float() - base.float()).abs().max().item()


def layouts(dev: str, once: bool) -> None:
    """once: one decode launch per layout at the first shape (profilers), nothing timed."""
    bw = kb.copy_bandwidth(dev, True, False)
    scales = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
    rows = []
    for label, lens in SHAPES[:1] if once else SHAPES:
        q = torch.randn(len(lens), 16, 128, device=dev).to(torch.bfloat16)
        sl = kb.i32(lens, dev)
        base = None
        for name, kc, vc, bt in fp8_layouts(lens, dev):
            call = functools.partial(paged_decode_attention_triton, q, kc, vc, bt, sl, 128**-0.5, *scales)
            if once:
                call()
                torch.cuda.synchronize()
                continue
            t, base, err = timed(call, base)
            nbytes = 2 * sum(lens) * 8 * 128
            rows.append(f"decode {label}, {name}: {t * 1e6:.0f} us ({nbytes / t / bw:.0%} of copy, err {err:.1e})")
            print(rows[-1], flush=True)
    if once:
        return
    # prefill: 16 prompts of 1024 tokens in one step (the workload's 16k-token prompt steps)
    lens = [1024] * 16
    qsl = kb.i32([1024 * i for i in range(17)], dev)
    sl = kb.i32(lens, dev)
    q = torch.randn(sum(lens), 16, 128, device=dev).to(torch.bfloat16)
    base = None
    flops = 4 * 16 * (1024 * 1025 // 2) * 16 * 128  # causal QK^T and PV
    for name, kc, vc, bt in fp8_layouts(lens, dev):
        call = functools.partial(paged_prefill_attention_triton, q, kc, vc, qsl, sl, bt, 1024, 1024, 128**-0.5,
                                 *scales)
        t, base, err = timed(call, base)
        rows.append(f"prefill 16 x 1024, {name}: {t * 1e6:.0f} us ({flops / t / 1e12:.0f} TFLOP/s, err {err:.1e})")
        print(rows[-1], flush=True)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s")
    print("\n".join(rows))


DIMS_MAJOR_KNOBS = [dict(), dict(num_stages=2), dict(num_stages=4), dict(num_warps=8), dict(block_n=128, num_stages=2),
                    dict(block_n=128, num_warps=8), dict(block_n=32, num_stages=4), dict(block_n=32, num_warps=2)]


def dims_major_sweep(dev: str) -> None:
    """The dims-major fp8 loop's tile knobs at the big-batch shapes (the defaults first), and the bf16 kernel on
    16- and 32-token pages of the same values."""
    bw = kb.copy_bandwidth(dev, True, False)
    scales = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
    rows = []
    for label, lens in SHAPES[:2] + SHAPES[3:4]:
        q = torch.randn(len(lens), 16, 128, device=dev).to(torch.bfloat16)
        sl = kb.i32(lens, dev)
        kc, vc, bt = engine_fp8_cache(lens, dev)
        base = None
        for kw in DIMS_MAJOR_KNOBS:
            call = functools.partial(paged_decode_attention_triton, q, kc, vc, bt, sl, 128**-0.5, *scales, **kw)
            t, base, err = timed(call, base)
            rows.append(f"fp8 dims-major {label} {kw or 'defaults'}: {t * 1e6:.0f} us "
                        f"({2 * sum(lens) * 8 * 128 / t / bw:.0%} of copy, err {err:.1e})")
            print(rows[-1], flush=True)
        del kc, vc
        k32, v32, bt32 = kb.paged_kv(lens, 8, 128, 32, torch.bfloat16, dev, table_width=128)
        for page, kc, vc, bt in ((16, *as_16_token_pages(k32, v32, bt32)), (32, k32, v32, bt32),
                                 ("32 heads-major", heads_major_copy(k32), heads_major_copy(v32), bt32)):
            t = kb.bench(functools.partial(paged_decode_attention_triton, q, kc, vc, bt, sl, 128**-0.5), True)
            rows.append(f"bf16 {label} {page}-token pages: {t * 1e6:.0f} us ({4 * sum(lens) * 8 * 128 / t / bw:.0%} of copy)")
            print(rows[-1], flush=True)
        del k32, v32
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s")
    print("\n".join(rows))


def workload_lens(n: int, step: int, seed: int) -> list[int]:
    """Context lengths of n sequences `step` decode steps into the DESIGN.md workload (random prompt lengths of
    100-1024 tokens, in admission order)."""
    rng = random.Random(seed)
    return [rng.randint(100, 1024) + step for _ in range(n)]


def engine_decode_step(lens: list[int], dev: str, cos_sin: torch.Tensor, norm_w: torch.Tensor):
    """One decode step as the engine launches it over the default fp8 cache (32-token pages, V dims-major): seq_lens,
    k_cache, v_cache, block tables, the raw queries and the rotary step (new token at position len - 1)."""
    sl = kb.i32(lens, dev)
    kc, vc, bt = engine_fp8_cache(lens, dev)
    return (sl, kc, vc, bt, *decode_rope_inputs(sl, bt, 32, dev, cos_sin, norm_w))


def decode_rope_inputs(sl: torch.Tensor, bt: torch.Tensor, page: int, dev: str, cos_sin: torch.Tensor,
                       norm_w: torch.Tensor):
    """A decode step's raw queries [num_seqs, 16, 128] (bf16) and its rotary step: random raw projections, the new
    token at position len - 1, stored in its slot of a cache with `page`-token pages."""
    from nvcli.kernels.decode_attention import DecodeRope

    qkv = torch.randn(len(sl), 32 * 128, device=dev).to(torch.bfloat16)
    q = qkv[:, : 16 * 128].view(-1, 16, 128)
    k = qkv[:, 16 * 128 : 24 * 128].view(-1, 8, 128)
    v = qkv[:, 24 * 128 :].view(-1, 8, 128)
    last = sl.long() - 1
    slots = bt.long().gather(1, (last // page)[:, None]).squeeze(1) * page + last % page
    return q, DecodeRope(k, v, last, cos_sin, slots, norm_w, norm_w, 1e-6)


def order_rope(dev: str, once: bool = False) -> None:
    """The default fp8 decode kernel (32-token pages, V dims-major) at the workload's big batches: without and
    with the rotary step folded in (as the engine runs it), and with the programs taking the sequences longest
    first (`order`) or in a pre-sorted batch.
    err: against the rotary launch in batch order (the order variants must give it bit for bit). once: one launch
    each of the first two variants at the first shape (profilers: `ncu_decode.sh rope`), nothing timed."""
    from nvcli.kernels.decode_attention import DecodeRope
    from nvcli.models.layers.rotary import RotaryEmbedding

    bw = kb.copy_bandwidth(dev, True, False)
    scales = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
    cos_sin = RotaryEmbedding(128, 4096, 1e6, None).cos_sin_cache.to(dev)
    norm_w = (1 + 0.1 * torch.randn(128)).to(dev).to(torch.bfloat16)
    shapes = [("256 x 790", [790] * 256), ("256 x workload step 300", workload_lens(256, 300, 1)),
              ("128 x workload step 700", workload_lens(128, 700, 2)),
              ("256 x 100-2000 shuffled", random.Random(3).sample([100 + (1900 * i) // 255 for i in range(256)], 256))]
    rows = []
    for label, lens in shapes[:1] if once else shapes:
        sl, kc, vc, bt, q, rope = engine_decode_step(lens, dev, cos_sin, norm_w)
        longest_first = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
        perm = longest_first.long()
        sorted_rope = DecodeRope(rope.k[perm], rope.v[perm], rope.positions[perm], cos_sin, rope.slot_mapping[perm],
                                 norm_w, norm_w, 1e-6)
        base_call = functools.partial(paged_decode_attention_triton, q, kc, vc, bt, sl, 128**-0.5, *scales)
        variants = [("no rotary", base_call, None), ("rotary (engine)", functools.partial(base_call, rope=rope), None),
                    ("rotary, longest first", functools.partial(base_call, rope=rope, order=longest_first), None),
                    ("rotary, batch pre-sorted", functools.partial(
                        paged_decode_attention_triton, q[perm], kc, vc, bt[perm].contiguous(), sl[perm].contiguous(),
                        128**-0.5, *scales, rope=sorted_rope), perm)]
        base = None
        nbytes = 2 * sum(lens) * 8 * 128
        if once:
            for _, call, _ in variants[:2]:
                call()
                torch.cuda.synchronize()
            return
        for name, call, out_perm in variants:
            out = call()
            if out_perm is not None:  # back to batch order
                out = torch.empty_like(out).index_copy_(0, out_perm, out)
            if name.startswith("rotary") and base is None:
                base = out
            err = 0.0 if base is None else (out.float() - base.float()).abs().max().item()
            t = kb.bench(call, True)
            rows.append(f"{label}, {name}: {t * 1e6:.1f} us ({nbytes / t / bw:.1%} of copy, err {err:.1e})")
            print(rows[-1], flush=True)
        del kc, vc
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s")
    print("\n".join(rows))


def split_sweep(dev: str) -> None:
    """The default fp8 kernel (32-token pages, V dims-major, rotary step folded in, as the engine launches it) at
    the batches that take KV splits (fewer than 4 programs per SM): split count, tile, warps and stages. The first
    row of each shape is the default launch; err against it."""
    from nvcli.kernels.decode_attention import choose_num_splits
    from nvcli.models.layers.rotary import RotaryEmbedding

    bw = kb.copy_bandwidth(dev, True, False)
    scales = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
    cos_sin = RotaryEmbedding(128, 4096, 1e6, None).cos_sin_cache.to(dev)
    norm_w = (1 + 0.1 * torch.randn(128)).to(dev).to(torch.bfloat16)
    shapes = [("64 x 1400", [1400] * 64), ("64 x workload step 900", workload_lens(64, 900, 4)),
              ("32 x 1500", [1500] * 32), ("16 x 1600", [1600] * 16)]
    rows = []
    for label, lens in shapes:
        sl, kc, vc, bt, q, rope = engine_decode_step(lens, dev, cos_sin, norm_w)
        auto = choose_num_splits(len(lens), 8, bt.shape[1] * 32, 64, 132)
        configs: list[dict] = [{}]
        for splits in sorted({max(1, auto // 2), auto, 2 * auto, 4 * auto}):
            for bn, warps, stages in ((64, 4, 3), (64, 4, 4), (64, 4, 2), (32, 4, 4), (32, 2, 4), (128, 4, 2),
                                      (128, 8, 3), (64, 8, 3)):
                configs.append(dict(num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages))
        nbytes = 2 * sum(lens) * 8 * 128
        results = []
        base = None
        for cfg in configs:
            call = functools.partial(paged_decode_attention_triton, q, kc, vc, bt, sl, 128**-0.5, *scales, rope=rope,
                                     **cfg)
            try:
                t, base, err = timed(call, base)
            except Exception as e:  # out of shared memory etc.
                print(f"  {cfg}: {type(e).__name__}", flush=True)
                continue
            results.append((t, err, cfg))
        default = results[0]
        best = sorted(results[1:], key=lambda r: r[0])[:5]
        line = (f"{label} (auto splits {auto}): default {default[0] * 1e6:.1f} us ({nbytes / default[0] / bw:.0%} of "
                f"copy); best " + ", ".join(
                    f"{c['num_splits']}/{c['block_n']}/{c['num_warps']}/{c['num_stages']} {t * 1e6:.1f} us "
                    f"({nbytes / t / bw:.0%}, err {e:.0e})" for t, e, c in best))
        print(line, flush=True)
        rows.append(line)
        del kc, vc
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; config = splits/block_n/warps/stages")
    print("\n".join(rows))


PREFILL_KNOBS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 64, 4, 3), (128, 128, 8, 2),
                 (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2),
                 (256, 64, 8, 3), (256, 32, 8, 3)]  # (block_m, block_n, num_warps, num_stages); the first: defaults


def prefill_sweep(dev: str) -> None:
    """Prefill attention at the workload's first prompt step (prompts of random 100-1024 tokens packed up to 16,384),
    bf16 (16-token pages) and fp8 (32-token pages, V dims-major), over tile knobs; TFLOP/s of the causal products,
    err against the defaults."""
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < 16384 - 1024:
        lens.append(rng.randint(100, 1024))
    qsl = kb.i32([sum(lens[:i]) for i in range(len(lens) + 1)], dev)
    sl = kb.i32(lens, dev)
    q = torch.randn(sum(lens), 16, 128, device=dev).to(torch.bfloat16)
    flops = sum(4 * (n * (n + 1) // 2) * 16 * 128 for n in lens)
    k16, v16, bt16 = kb.paged_kv(lens, 8, 128, 16, torch.bfloat16, dev, table_width=128)
    k8, v8, bt8 = engine_fp8_cache(lens, dev)
    scales = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
    rows = []
    for name, kc, vc, bt, sc in (("bf16", k16, v16, bt16, (None, None)), ("fp8", k8, v8, bt8, scales)):
        base = None
        for bm, bn, warps, stages in PREFILL_KNOBS:
            call = functools.partial(paged_prefill_attention_triton, q, kc, vc, qsl, sl, bt, max(lens), max(lens),
                                     128**-0.5, *sc, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            try:
                t, base, err = timed(call, base)
            except Exception as e:  # out of shared memory etc.
                print(f"{name} {bm}/{bn}/{warps}/{stages}: {type(e).__name__}", flush=True)
                continue
            rows.append(f"prefill {len(lens)} prompts / {sum(lens)} tokens, {name} {bm}/{bn}/{warps}/{stages}: "
                        f"{t * 1e6:.0f} us ({flops / t / 1e12:.0f} TFLOP/s, err {err:.1e})")
            print(rows[-1], flush=True)
    print("\nknobs = block_m/block_n/warps/stages, the first of each dtype the defaults")
    print("\n".join(rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--once", action="store_true", help="one launch per variant at the first shape (profilers)")
    ap.add_argument("--layouts", action="store_true", help="fp8 page layouts side by side (decode and prefill)")
    ap.add_argument("--dims-major-sweep", action="store_true", help="tile knobs of the dims-major fp8 loop")
    ap.add_argument("--order-rope", action="store_true", help="the rotary step's cost, prefetch and program order")
    ap.add_argument("--split-sweep", action="store_true", help="fp8 split count and tile knobs at small batches")
    ap.add_argument("--prefill-sweep", action="store_true", help="prefill attention tile knobs, bf16 and fp8")
    ap.add_argument("--variants", default="", help="comma-separated labels (default: all)")
    args = ap.parse_args()
    studies = [(args.prefill_sweep, lambda: prefill_sweep("cuda")), (args.split_sweep, lambda: split_sweep("cuda")),
               (args.order_rope, lambda: order_rope("cuda", args.once)),
               (args.dims_major_sweep, lambda: dims_major_sweep("cuda")), (args.layouts, lambda: layouts("cuda", args.once))]
    for chosen, study in studies:
        if chosen:
            torch.manual_seed(0)
            study()
            return 0
    variants = [v for v in VARIANTS if not args.variants or v[0] in args.variants.split(",")]
    dev = "cuda"
    torch.manual_seed(0)
    bw = kb.copy_bandwidth(dev, True, False)
    shapes = SHAPES[:1] if args.once else SHAPES
    rows = []
    for label, lens in shapes:
        kc16, vc16, bt = kb.paged_kv(lens, 8, 128, 16, torch.bfloat16, dev, table_width=256)
        k8, _ = kb.quantize(kc16, 0.02)
        v8, _ = kb.quantize(vc16, 0.02)
        scales = torch.tensor([0.02], device=dev), torch.tensor([0.02], device=dev)
        q = torch.randn(len(lens), 16, 128, device=dev).to(torch.bfloat16)
        sl = kb.i32(lens, dev)
        ref = {}
        times = []
        for name, fp8, kw in variants:
            kc, vc = (k8, v8) if fp8 else (kc16, vc16)
            ks, vs = scales if fp8 else (None, None)

            call = functools.partial(paged_decode_attention_triton, q, kc, vc, bt, sl, 128**-0.5, ks, vs, **kw)

            out = call()
            torch.cuda.synchronize()
            if args.once:
                continue
            base = ref.setdefault(fp8, out)
            err = (out.float() - base.float()).abs().max().item()
            t = kb.bench(call, True)
            nbytes = 2 * sum(lens) * 8 * 128 * (1 if fp8 else 2)
            times.append(f"{name} {t * 1e6:.0f} us ({nbytes / t / bw:.0%}, err {err:.1e})")
            print(f"{label}: {times[-1]}", flush=True)
        rows.append(f"{label}: " + "; ".join(times))
        del kc16, vc16, k8, v8
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
