"""Where the DESIGN workload's wall time goes, by kind of step (issue #57): prompt / mixed steps, and decode steps by
how many rows they decode. Compares tensor-parallel sizes (or two flags) step kind by step kind, where the workload's
single throughput figure cannot say whether TP loses in its prompt steps, its full-batch decode or its tail.

The workload is `nv bench`'s (nvcli/bench.py: 256 requests, one warm-up generate first). Every `engine.step()` call is
timed on the host. With async scheduling a call launches its batch and then waits for the previous one, so a call's
time is attributed to the batch it waited for (the previous call's); without it, to its own. The sum of the buckets
is the run's wall time.

    PYTHONPATH=. python3 benchmarks/workload_steps.py --model qwen3-8b --tp 1 --json $OUT/tp1.json
    PYTHONPATH=. python3 benchmarks/workload_steps.py --model qwen3-8b --tp 2 --json $OUT/tp2.json
    PYTHONPATH=. python3 benchmarks/workload_steps.py --device cpu --model tiny-qwen3 --num-prompts 8 \\
        --output-len 4-12 --input-len 8-32                                            # CPU: code paths only

Prints `## name: value` rows, then one table row per bucket: steps, seconds, ms per step, share of the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile_gpu import design_max_model_len, model_dir, row  # noqa: E402

BUCKETS = ("prompt/mixed", "decode >=192 rows", "decode 64-191", "decode 16-63", "decode 2-15", "decode 1 row")


def bucket(batch) -> str:
    if not batch.is_decode_only:
        return BUCKETS[0]
    rows = len(batch.seqs)
    for name, lo in zip(BUCKETS[1:], (192, 64, 16, 2, 1)):
        if rows >= lo:
            return name
    return BUCKETS[-1]


def run(args) -> dict:
    from nvcli.bench import make_workload, parse_range, run_workload
    from nvcli.config import EngineConfig
    from nvcli.engine.llm_engine import LLMEngine

    tmp = Path(tempfile.mkdtemp(prefix="nv-workload-steps-"))
    path = model_dir(args.model, tmp)
    config = EngineConfig(model=path, tensor_parallel_size=args.tp, load_format="dummy", device=args.device,
                          quantization=args.quantization, max_model_len=design_max_model_len(path))
    engine = LLMEngine(config)
    kinds: list[str] = []
    schedule = engine.scheduler.schedule

    def recording(*a, **kw):
        batch = schedule(*a, **kw)
        kinds.append(bucket(batch) if batch.seqs else "empty")
        return batch

    engine.scheduler.schedule = recording
    times: list[float] = []
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t)
        return out

    work = make_workload(args.num_prompts, parse_range(args.input_len, "--input-len"),
                         parse_range(args.output_len, "--output-len"))
    try:
        run_workload(engine, make_workload(1, (16, 16), (8, 8), seed=1))  # nv bench's warm-up generate
        engine.reset_prefix_cache()
        kinds.clear()
        engine.step = timed_step
        wall = run_workload(engine, work)
    finally:
        engine.shutdown()
    shift = 1 if engine.async_scheduling else 0
    per: dict[str, list[float]] = {name: [] for name in (*BUCKETS, "empty")}
    for i, t in enumerate(times):
        per[kinds[i - shift] if i >= shift else kinds[0]].append(t)
    tok_s = work.output_tokens / wall
    row("run", f"{args.model} TP={args.tp} quantization={args.quantization}: "
        f"{tok_s:.0f} output tok/s, {wall:.2f} s, {len(times)} steps")
    table = {name: {"steps": len(v), "s": sum(v), "ms_per_step": 1000 * sum(v) / len(v) if v else 0.0,
                    "share": sum(v) / wall} for name, v in per.items() if v}
    print("| step kind | steps | s | ms / step | share |\n| --- | --- | --- | --- | --- |")
    for name, b in table.items():
        print(f"| {name} | {b['steps']} | {b['s']:.2f} | {b['ms_per_step']:.2f} | {100 * b['share']:.0f}% |")
    out = {"model": args.model, "tp": args.tp, "quantization": args.quantization, "wall_s": wall,
           "output_tok_s": tok_s, "buckets": table}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", help="preset, tiny-<arch> or a model directory")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", default="100-1024")
    ap.add_argument("--output-len", default="100-1024")
    ap.add_argument("--json", default=None, help="write the buckets here")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
