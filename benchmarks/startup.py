"""Start-up on one GPU: engine construction to the first generated token, phase by phase, with every
Triton compile timed (the DESIGN workload's engine: dummy Qwen3-0.6B, max_model_len 4096, 512 sequences).

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python3 benchmarks/startup.py   # cold: nothing compiled
    PYTHONPATH=. python3 benchmarks/startup.py                                 # run again: warm disk cache

A user's first run on a machine is the cold case; every later run finds Triton's disk cache warm.
Prints the phases (weights, KV-cache sizing, CUDA graphs, kernel warm-up), the compiles per kernel
and their wall time, and the time to the first token (the `## ` rows, which benchmarks/ab.py reads).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # before the imports: torch, triton and transformers count as start-up

import argparse  # noqa: E402
import cProfile  # noqa: E402
import logging  # noqa: E402
import pstats  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from nvcli import LLM, SamplingParams  # noqa: E402
from nvcli.models.presets import preset_dir  # noqa: E402

_started: dict[str, float] = {}
compiles: dict[str, list[float]] = defaultdict(list)
reprs: list[tuple[str, float]] = []


def _before(*, key: str, repr: str, fn, compile, is_manual_warmup: bool, already_compiled: bool) -> None:
    _started[key + fn.name] = time.perf_counter()
    return None


def _after(*, key: str, repr: str, fn, compile, is_manual_warmup: bool, already_compiled: bool) -> None:
    t = _started.pop(key + fn.name, None)
    if t is not None:
        compiles[fn.name].append(time.perf_counter() - t)
        reprs.append((repr, compiles[fn.name][-1]))
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="cProfile the engine's construction and first token")
    ap.add_argument("--verbose", action="store_true",
                    help="print every Triton compile, and when each compile-ahead variant was submitted, started and "
                         "finished")
    args = ap.parse_args()
    logging.basicConfig(format="%(message)s")
    # the engine's start-up lines (with --verbose, compile-ahead's timeline too)
    logging.getLogger("nvcli").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    t_imports = time.perf_counter() - T_START
    triton.knobs.runtime.jit_cache_hook = _before
    triton.knobs.runtime.jit_post_compile_hook = _after
    cache = Path(triton.knobs.cache.dir)  # TRITON_CACHE_DIR, or Triton's default
    entries = len(list(cache.glob("*"))) if cache.exists() else 0
    model_dir = str(preset_dir("qwen3-0.6b", Path(tempfile.mkdtemp())))
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    torch.zeros(1, device="cuda")  # CUDA context: counted, it is part of a user's start-up
    t_ctx = time.perf_counter() - t0
    llm = LLM(model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=16384, kv_cache_dtype=args.kv_cache_dtype)
    t_engine = time.perf_counter() - t0
    llm.generate(["hello"], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    t_first = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        pstats.Stats(prof).print_callers("_register_to_dispatcher|custom_ops.py.*inner")
    runner = llm.engine.executor.runner
    total_compile = sum(sum(v) for v in compiles.values())
    print(f"Triton cache {cache}: {entries} entries before")
    print(f"CUDA context {t_ctx:.1f} s; model runner: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in runner.startup_s.items()))
    print(f"{sum(len(v) for v in compiles.values())} Triton compiles, {total_compile:.1f} s:")
    for name, times in sorted(compiles.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:<40} {len(times):>3} variants {sum(times):6.1f} s")
    for what, secs in reprs if args.verbose else []:
        print(f"  {secs:5.2f} s {what}")
    print(f"## imports {t_imports:.1f} s (torch, triton, nvcli; transformers loads lazily)")
    print(f"## process start to first token: {t_imports + t_first:.1f} s (imports included)")
    print(f"## start-up to first token ({args.kv_cache_dtype} KV): "
          f"{t_first:.1f} s (engine ready {t_engine:.1f} s; Triton compiles {total_compile:.1f} s)")


if __name__ == "__main__":
    main()
