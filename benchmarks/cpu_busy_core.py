"""One request's decode speed on the CPU with and without a core kept busy by another process.

    python benchmarks/cpu_busy_core.py                    # nv as shipped, then as it ran before
    python benchmarks/cpu_busy_core.py --rounds 5 --variants nv,before,one-thread,short-spin,spin-1k

The busy core is `yes > /dev/null`. Each variant runs in a process of its own (OpenMP reads its wait policy when torch
loads): `nv` is nv's default (one thread per CPU, idle threads sleeping at once: nvcli/cpu_threads.py); `before` is
what nv ran before, spinning threads (GOMP_SPINCOUNT=300000, GNU OpenMP's own default without a policy);
`one-thread` is --cpu-threads 1; `short-spin` and `spin-1k` spin 10,000 and 1,000 turns before sleeping. Per round a
variant measures ms per output token idle, then with `yes` running (the latency of `nv bench --device cpu --latency`:
bench.latency, the median of 3 requests); rounds alternate so that other load on the machine falls on both. The table gives the medians and their ratio; nv's must stay at most 2.
The load average printed beside it says how idle "idle" was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL = -1  # --cpu-threads: one per CPU
VARIANTS: dict[str, tuple[dict[str, str], int | None]] = {
    "nv": ({}, None),
    "before": ({"GOMP_SPINCOUNT": "300000"}, ALL),
    "one-thread": ({}, 1),
    "short-spin": ({"GOMP_SPINCOUNT": "10000"}, None),
    "spin-1k": ({"GOMP_SPINCOUNT": "1000"}, None),
}
LIMIT = 2.0


def child(variant: str, input_len: int, output_len: int, rounds: int) -> None:
    """Runs in the variant's own process: one engine, `rounds` pairs of idle and busy measurements (JSON lines)."""
    from nvcli import LLM  # before torch: sets the wait policy (unless the variant's environment set one)
    from nvcli.bench import latency
    from nvcli.cpu_threads import default_cpu_threads

    threads = VARIANTS[variant][1]
    threads = default_cpu_threads() if threads == ALL else threads
    llm = LLM(device="cpu", max_model_len=256, max_num_seqs=4, num_kvcache_blocks=64, cpu_threads=threads)
    import torch

    for r in range(rounds):
        for busy in (False, True):
            hog = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
            try:
                ms = latency(llm.engine, input_len, output_len, repeats=3)["ms_per_output_token"]
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            print(json.dumps({"variant": variant, "round": r, "busy": busy, "ms_per_token": ms,
                              "threads": torch.get_num_threads(), "wait": os.environ.get("OMP_WAIT_POLICY"),
                              "loadavg": os.getloadavg()[0]}), flush=True)
    llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="nv,before", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.input_len, args.output_len, args.rounds)
        return 0
    print(f"{os.cpu_count()} CPUs; {args.rounds} rounds; {args.input_len}-token prompt, {args.output_len} tokens; "
          f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for variant in args.variants.split(","):
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")}
        env.update(VARIANTS[variant][0])
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--rounds", str(args.rounds),
                              "--input-len", str(args.input_len), "--output-len", str(args.output_len)],
                             env=env, capture_output=True, text=True, check=True).stdout
        runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for run in runs:
            print(f"  {variant:10s} round {run['round']} {'busy' if run['busy'] else 'idle'}: "
                  f"{run['ms_per_token']:8.1f} ms/token (load {run['loadavg']:.2f})", flush=True)
        idle = statistics.median(r["ms_per_token"] for r in runs if not r["busy"])
        busy = statistics.median(r["ms_per_token"] for r in runs if r["busy"])
        threads = "/".join(str(n) for n in sorted({r["threads"] for r in runs}, reverse=True))
        rows.append((variant, threads, runs[0]["wait"] or "-", idle, busy, busy / idle))
    print(f"\n{'variant':10s} {'threads':>7s} {'wait':>8s} {'idle ms/tok':>12s} {'busy ms/tok':>12s} {'ratio':>6s}")
    for variant, threads, wait, idle, busy, ratio in rows:
        print(f"{variant:10s} {threads:>7s} {wait:>8s} {idle:12.1f} {busy:12.1f} {ratio:6.2f}")
    nv = next((r for r in rows if r[0] == "nv"), None)
    if nv is not None and nv[5] > LIMIT:
        print(f"nv: busy / idle = {nv[5]:.2f} > {LIMIT}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
