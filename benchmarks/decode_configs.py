"""Decode-step kernel configs tried end to end: each skinny-GEMM config and decode-attention setting is
swapped into the real chain (CUDA graph, PDL) in one process, and timed as one request's ms per output
token (or, with --rows N, as ms per decode step of N requests).

    PYTHONPATH=. python3 benchmarks/decode_configs.py [--repeats 3] [--output-len 512]
    PYTHONPATH=. python3 benchmarks/decode_configs.py --rows 8 --output-len 256 --repeats 2 --rounds 2
    PYTHONPATH=. python3 benchmarks/decode_configs.py --batches 1,2,4,8,16 --output-len 256 --rounds 2

One request: phase 1 runs session 5's looped GEMM tiles, the defaults, and the defaults with 16 attention
splits in turn (the batch-1 graph is recaptured for each). Phase 2 changes one layer shape at a time around
the defaults (CANDIDATES; with --rows, the tensor-core ROWS_CANDIDATES), with the defaults again after each
shape to show drift. Phase 3 combines the variants that beat the defaults by 1% and runs them against the
defaults in turn. --batches only times decode steps of those batch sizes under each of BATCH_MODES (which
rows take which tiles), in turn. The kernel isolation benchmarks (skinny_gemm.py) time a GEMM alone; here a
config also pays for how it overlaps its neighbours under PDL, which is what a small batch's step is made of.
Prints a table last. (The sampler's own benchmark is sampler_gpu.py.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nvcli import LLM, SamplingParams
from nvcli.bench import latency
from nvcli.kernels import decode_attention, pdl, skinny_gemm
from nvcli.kernels.skinny_gemm import MidTiles, SkinnyConfig
from nvcli.models.presets import preset_dir

C = SkinnyConfig
# Qwen3-0.6B's one-row GEMMs (N, K)
SHAPES: dict[str, tuple[int, int]] = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
                                       "down": (1024, 3072), "lm_head": (151936, 1024)}
# the configs choose_config gave them before the one-pass tiles (session 5, v8)
LOOPED = {"qkv": C(16, 512, num_stages=2), "o_proj": C(4, 2048, num_stages=1), "gate_up": C(32, 256, num_stages=3),
          "down": C(4, 1024, num_stages=3)}
# candidates around the defaults: (block_n, block_k, split, dot, warps, stages). The one-warp tiles are untimed
# (session 6 ran out of device time): compiled for sm_90a their row sums need no cross-warp step (0 bar.sync
# against 4-7 at 4 warps), which is what each extra row of the one-pass tiles pays for
CANDIDATES: dict[str, list[SkinnyConfig]] = {
    "qkv": [C(4, 1024, num_stages=1), C(8, 1024, num_warps=8, num_stages=1), C(16, 1024, num_warps=8, num_stages=1),
            C(2, 1024, num_warps=1, num_stages=1)],
    "o_proj": [C(2, 2048, num_stages=1), C(4, 2048, num_warps=8, num_stages=1), C(8, 2048, num_warps=8, num_stages=1),
               C(1, 2048, num_warps=1, num_stages=1)],
    "gate_up": [C(4, 1024, num_stages=1), C(8, 1024, num_warps=8, num_stages=1), C(16, 1024, num_warps=8, num_stages=1),
                C(2, 1024, num_warps=1, num_stages=1)],
    "down": [C(4, 1024, num_warps=8, num_stages=3), C(4, 4096, num_warps=8, num_stages=1),
             C(2, 4096, num_warps=8, num_stages=1), C(1, 4096, num_stages=1), C(1, 4096, num_warps=2, num_stages=1)],
    "lm_head": [C(64, 128, num_warps=8, num_stages=3), C(8, 1024, num_stages=1), C(32, 256, num_warps=8, num_stages=3)],
}
# tensor-core tiles for 5-16 rows (--rows): (block_n, block_k, split, dot, warps, stages)
ROWS_CANDIDATES: dict[str, list[SkinnyConfig]] = {
    "qkv": [C(32, 512, 1, True, 4, 2), C(32, 1024, 1, True, 8, 1), C(64, 256, 1, True, 4, 4), C(32, 128, 1, True, 4, 4),
            C(32, 256, 2, True, 4, 2)],
    "o_proj": [C(32, 512, 4, True, 4, 1), C(32, 256, 8, True, 4, 1), C(32, 128, 8, True, 4, 2), C(64, 256, 8, True, 4, 1),
               C(32, 256, 2, True, 4, 4)],
    "gate_up": [C(32, 512, 1, True, 4, 2), C(32, 1024, 1, True, 8, 1), C(64, 256, 1, True, 4, 4), C(32, 256, 2, True, 4, 2)],
    "down": [C(32, 256, 12, True, 4, 1), C(32, 512, 6, True, 4, 1), C(32, 256, 6, True, 4, 2), C(64, 256, 8, True, 4, 2),
             C(32, 128, 8, True, 4, 3)],
    "lm_head": [],
}
ATTENTION: list[dict] = [dict(num_splits=16), dict(num_splits=8)]


class Overrides:
    """Swaps one-row GEMM configs and decode-attention keyword arguments into the kernels' entry points."""

    def __init__(self, rows: int = 1) -> None:
        self.rows = rows  # the batch size whose GEMMs and attention take the overrides
        self.gemm: dict[tuple[int, int], SkinnyConfig] = {}
        self.attn: dict = {}
        self._choose = skinny_gemm.choose_config
        self._attention = decode_attention.paged_decode_attention_triton
        skinny_gemm.choose_config = self.choose_config
        decode_attention.paged_decode_attention_triton = self.attention

    def choose_config(self, m: int, n: int, k: int, elt: int, sms: int) -> SkinnyConfig:
        if m == self.rows and (n, k) in self.gemm:
            return self.gemm[(n, k)]
        return self._choose(m, n, k, elt, sms)

    def attention(self, q, *args, **kwargs):
        if q.shape[0] == self.rows:
            kwargs = {**kwargs, **self.attn}
        return self._attention(q, *args, **kwargs)


@torch.inference_mode()
@torch.inference_mode()
def recapture_graphs(runner, max_bs: int) -> None:
    """Recapture every decode graph of at most max_bs rows (their configs may have changed)."""
    torch.cuda.synchronize()
    for bs in [s for s in runner.graph_batch_sizes if s <= max_bs]:
        runner._graph_forward(bs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            runner.graph_outputs[bs] = runner._graph_forward(bs)
        runner.graphs[bs] = graph
    torch.cuda.synchronize()


def step_ms(engine, batch: int, output_len: int, tag: str) -> float:
    """ms per decode step with `batch` greedy requests of 128 prompt tokens, after all have their first token."""
    rng = random.Random(batch)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    g0 = engine.stats().generation_tokens
    for i in range(batch):
        engine.add_request([rng.randint(0, 10000) for _ in range(128)], sp, request_id=f"{tag}-{batch}-{i}")
    while engine.stats().generation_tokens - g0 < batch:
        engine.step()
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return 1000 * (time.perf_counter() - t0) / max(1, steps)


# (label, ONE_PASS_MAX_M, FUSED_SPLIT, DOT_WIDE): up to ONE_PASS_MAX_M rows take the one-pass CUDA-core tiles
# (rows one at a time from the weight tile in registers), more rows the looped tensor-core tiles, which split K
# for o_proj and down_proj; FUSED_SPLIT: the last split sums the partials instead of a second kernel;
# DOT_WIDE: those tiles are 64 x 256 with K split to fill the SMs (else 32 x 256, K split less)
BATCH_MODES = [("v8 tiles, reduce kernel", 2, False, False), ("session 6, narrow tensor-core tiles", 4, True, False),
               ("session 6, wide tensor-core tiles (default)", 4, True, True)]


def batch_phase(engine, runner, batches: list[int], rounds: int, output_len: int) -> list[str]:
    """Decode steps of 1-16 rows under each of BATCH_MODES, in turn."""
    modes = [(label, {(skinny_gemm, "ONE_PASS_MAX_M"): max_m, (skinny_gemm, "FUSED_SPLIT"): fused,
                      (skinny_gemm, "DOT_WIDE"): wide}) for label, max_m, fused, wide in BATCH_MODES]
    return modes_phase(engine, runner, batches, rounds, output_len, modes)


def modes_phase(engine, runner, batches: list[int], rounds: int, output_len: int,
                modes: list[tuple[str, dict[tuple[object, str], object]]]) -> list[str]:
    """ms per decode step of each batch size under each mode (label, {(module, attribute): value}), the modes in
    turn in every round, graphs recaptured for each; the attributes are restored at the end. Prints and returns
    a table of the medians over the rounds."""
    times: dict[tuple[int, str], list[float]] = {}
    saved = {key: getattr(*key) for _, values in modes for key in values}

    def set_attrs(values: dict[tuple[object, str], object]) -> None:
        for (module, name), value in values.items():
            setattr(module, name, value)
        skinny_gemm.choose_config.cache_clear()

    for r in range(rounds):
        for label, values in modes:
            set_attrs(values)
            recapture_graphs(runner, max(batches))
            for b in batches:
                times.setdefault((b, label), []).append(step_ms(engine, b, output_len, f"r{r}-{label}"))
            print(label, {b: round(times[(b, label)][-1], 4) for b in batches}, flush=True)
    set_attrs(saved)
    labels = [label for label, _ in modes]
    lines = ["| rows | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for b in batches:
        lines.append(f"| {b} | " + " | ".join(f"{statistics.median(times[(b, label)]):.4f}" for label in labels) + " |")
    lines.append("(ms per decode step, median of the rounds)")
    print("\n".join(lines), flush=True)
    return lines


# (label, use_skinny's row bound, PDL's row bound, tiles of 17+ rows, rows up to which SiLU is fused into down_proj)
MID_MODES: list[tuple[str, int, int, MidTiles, int]] = [
    ("cuBLAS", 16, 16, MidTiles(), 16),
    ("cuBLAS, PDL", 16, 256, MidTiles(), 16),
    ("tiles, no PDL", 256, 16, MidTiles(), 256),
    ("tiles", 256, 256, MidTiles(), 256),
    ("tiles, SiLU kernel", 256, 256, MidTiles(), 16),
    ("tiles bm64", 256, 256, MidTiles(max_block_m=64), 256),
    ("tiles bm256 w8 s3", 256, 256, MidTiles(max_block_m=256, num_warps=8, num_stages=3), 256),
    ("tiles bk128 s3", 256, 256, MidTiles(block_k=128, num_stages=3), 256),
    ("tiles fill1", 256, 256, MidTiles(fill=1.0), 256),
    ("tiles bn128 w8 s3", 256, 256, MidTiles(block_n=128, num_warps=8, num_stages=3), 256),
]


def mid_phase(engine, runner, batches: list[int], rounds: int, output_len: int, only: str) -> list[str]:
    """Decode steps of 17-256 rows with cuBLAS or the tensor-core tiles (MID_MODES; `only`: labels to keep,
    comma-separated), the chain with or without PDL, in turn."""
    modes = [(label, {(skinny_gemm, "MAX_M"): max_m, (pdl, "MAX_ROWS"): pdl_rows, (skinny_gemm, "MID_TILES"): tiles,
                      (skinny_gemm, "SILU_FUSED_MAX_M"): silu})
             for label, max_m, pdl_rows, tiles, silu in MID_MODES if not only or label in only.split(",")]
    return modes_phase(engine, runner, batches, rounds, output_len, modes)


def describe(cfg: SkinnyConfig) -> str:
    return f"n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}" + (f" split{cfg.split_k}" if cfg.split_k > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1, help="sweep the configs of this batch size (ms per decode step)")
    ap.add_argument("--batches", default="", help="e.g. 1,2,4,8,16: only compare BATCH_MODES per batch size")
    ap.add_argument("--only", default="", help="comma-separated shape names (and/or 'attention') to sweep; "
                    "with --mid, MID_MODES labels")
    ap.add_argument("--mid", default="", help="e.g. 32,64,128,256: only compare MID_MODES per batch size")
    args = ap.parse_args()
    model_dir = str(preset_dir("qwen3-0.6b", Path(tempfile.mkdtemp())))
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=16384)
    engine, runner = llm.engine, llm.engine.executor.runner
    if args.mid:
        lines = mid_phase(engine, runner, [int(b) for b in args.mid.split(",")], args.rounds, args.output_len, args.only)
        llm.shutdown()
        print("\n".join(lines))
        return
    if args.batches:
        lines = batch_phase(engine, runner, [int(b) for b in args.batches.split(",")], args.rounds, args.output_len)
        llm.shutdown()
        print("\n".join(lines))
        return
    ov = Overrides(args.rows)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    defaults = {name: skinny_gemm.choose_config(args.rows, n, k, 2, sms) for name, (n, k) in SHAPES.items()}
    if args.rows > 1:  # tensor-core candidates around the defaults of a few rows
        CANDIDATES.clear()
        CANDIDATES.update(ROWS_CANDIDATES)
        LOOPED.clear()

    def measure(gemm: dict[tuple[int, int], SkinnyConfig], attn: dict) -> float:
        ov.gemm, ov.attn = gemm, attn
        recapture_graphs(runner, args.rows)
        if args.rows == 1:
            return latency(engine, 128, args.output_len, repeats=args.repeats)["ms_per_output_token"]
        return statistics.median(step_ms(engine, args.rows, args.output_len, f"sweep{i}") for i in range(args.repeats))

    rows: list[tuple[str, str, float]] = []
    base_runs: list[float] = []

    def base(tag: str) -> float:
        t = measure({}, {})
        base_runs.append(t)
        rows.append(("defaults", tag, t))
        print(f"defaults ({tag}): {t:.4f} ms/token", flush=True)
        return t

    # phase 1: the looped tiles of v8 against today's defaults, in turn
    looped = {SHAPES[name]: cfg for name, cfg in LOOPED.items()}
    compare: dict[str, list[float]] = {"looped (v8)": [], "defaults": [], "defaults, 16 attention splits": []}
    for r in range(args.rounds if args.rows == 1 else 0):
        compare["looped (v8)"].append(measure(looped, {}))
        compare["defaults"].append(base(f"round {r}"))
        compare["defaults, 16 attention splits"].append(measure({}, dict(num_splits=16)))
        print({k: round(v[-1], 4) for k, v in compare.items()}, flush=True)

    if args.rows > 1:
        base("start")
    # phase 2: one shape at a time around the defaults
    best: dict[str, tuple[float, object]] = {}
    only = set(filter(None, args.only.split(",")))
    for name, (n, k) in SHAPES.items():
        if only and name not in only:
            continue
        print(f"{name} ({n}x{k}) default {describe(defaults[name])}", flush=True)
        for cfg in CANDIDATES[name]:
            try:
                t = measure({(n, k): cfg}, {})
            except Exception as e:  # out of registers / shared memory
                print(f"  {describe(cfg)}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            rows.append((name, describe(cfg), t))
            print(f"  {describe(cfg)}: {t:.4f}", flush=True)
            if t < best.get(name, (1e9, None))[0]:
                best[name] = (t, cfg)
        base(f"after {name}")
    if not only or "attention" in only:
        for kw in ATTENTION:
            t = measure({}, kw)
            rows.append(("attention", str(kw), t))
            print(f"  attention {kw}: {t:.4f}", flush=True)
            if t < best.get("attention", (1e9, None))[0]:
                best["attention"] = (t, kw)
        base("after attention")

    # phase 3: the variants that beat the defaults by 1%, together, against the defaults in turn
    ref = statistics.median(base_runs)
    gemm = {SHAPES[name]: cfg for name, (t, cfg) in best.items() if name != "attention" and t < ref * 0.99}
    attn = best["attention"][1] if "attention" in best and best["attention"][0] < ref * 0.99 else {}
    combined: list[float] = []
    if gemm or attn:
        for r in range(args.rounds):
            combined.append(measure(gemm, attn))
            base(f"combined round {r}")
    print("\n| what | config | ms/token |\n| --- | --- | --- |")
    for name, cfg, t in rows:
        print(f"| {name} | {cfg} | {t:.4f} |")
    print("\nin turn, median of rounds:")
    for name, ts in compare.items():
        if not ts:
            continue
        print(f"  {name}: {statistics.median(ts):.4f} ms/token {[round(t, 4) for t in ts]}")
    print(f"defaults: median {ref:.4f} ms/token over {len(base_runs)} runs ({min(base_runs):.4f}-{max(base_runs):.4f})")
    if combined:
        picked = ", ".join(f"{n}: {describe(c)}" for n, (t, c) in best.items() if n != "attention" and SHAPES[n] in gemm)
        print(f"combined ({picked}{', attention ' + str(attn) if attn else ''}): {[round(t, 4) for t in combined]} "
              f"vs defaults in the same rounds {[round(t, 4) for t in base_runs[-args.rounds:]]}")
    llm.shutdown()


if __name__ == "__main__":
    main()
