"""Where a steady decode step's time goes (issue #57): GEMMs, attention, all-reduce, norms and elementwise, sampling,
copies and the host, per step, at any tensor-parallel size; with `--phase prompt`, a prompt step's.

B requests (`--batch`, default 256) of C random token ids (`--prompt-len`, default 600; DESIGN.md's workload averages
~560) on dummy weights of a model preset, max_tokens up to max_model_len, ignore_eos: the engine steps until every
request is decoding (`--phase prompt`: one-token requests of C ids, enough that every step below prefills
`--max-num-batched-tokens` tokens), then
1. times `--steps` such steps (default 20) with the device synchronised at both ends of the window (the pipelined
   period, async scheduling's overlap of host and device included), then as many synchronised after every step
   (no overlap: host + device in series);
2. profiles `--profile-steps` more (default 10) with torch.profiler (CPU + CUDA activities) in this process, which
   is tensor-parallel rank 0 (nvcli/engine/tp_executor.py: rank 0 runs in the engine's process, ranks 1..N-1 are
   spawned workers, not profiled); its GPU kernels are put in categories by name.
Kernels launched from CUDA-graph replays appear in the trace as kernel records of their own (CUPTI attributes them to
the cudaGraphLaunch); the script warns if a profile on a GPU holds no kernel, in which case rerun with
`--enforce-eager`. Per category: GPU ms per step (summed kernel durations) and its share of the pipelined wall time;
then GPU busy (the union of kernel intervals) and host/idle = wall - busy (wall unprofiled, kernels profiled: a small
negative host/idle means the profiler slowed the kernels, not that the host is free). On TP > 1 the all-reduce
kernels' time includes waiting for the slower rank, and rank 0 alone is profiled.

    PYTHONPATH=. python3 benchmarks/step_profile_gpu.py --model qwen3-8b --tp 1 --json tp1.json
    PYTHONPATH=. python3 benchmarks/step_profile_gpu.py --model qwen3-8b --tp 2 --json tp2.json
    PYTHONPATH=. python3 benchmarks/step_profile_gpu.py --model qwen3-8b --tp 4 --json tp4.json
    for tp in 1 2 4; do PYTHONPATH=. python3 benchmarks/step_profile_gpu.py --tp $tp --json $OUT/tp$tp.json \\
        --trace $OUT/tp$tp.trace.json || echo "TP=$tp FAILED"; done                  # all three, 4 GPUs, one call
    PYTHONPATH=. python3 benchmarks/step_profile_gpu.py --model qwen3-8b --tp 2 --quantization fp8 --kv-cache-dtype fp8
    PYTHONPATH=. python3 benchmarks/step_profile_gpu.py --model llama-3-70b --tp 4 --json llama70b-tp4.json
    PYTHONPATH=. python3 benchmarks/step_profile_gpu.py --model qwen3-8b --tp 2 --phase prompt --prompt-len 1024
                                                   # prompt steps of --max-num-batched-tokens (16,384) tokens
    PYTHONPATH=. python3 benchmarks/step_profile_gpu.py --device cpu --model tiny-qwen3 --tp 2 --batch 4 \\
        --prompt-len 24 --steps 3 --profile-steps 2                                  # CPU: code paths only

`--model`: a preset (qwen3-0.6b, qwen3-8b, qwen3-32b, qwen3-30b-a3b, llama-3-8b, llama-3-70b), `tiny-<arch>` (a
random tiny checkpoint as the tests build: qwen3, llama, qwen2, qwen3_moe) or a model directory. `--trace PATH`
writes the profile as a Chrome trace. Prints `## name: value` rows, then the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

# Kernel (or, on CPU, operator) name -> category: the first category with a substring of the lower-cased name wins.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("all-reduce", ("nccl", "allreduce", "all_reduce", "one_shot", "two_shot", "multimem", "symm_mem",
                    "cross_device", "gloo", "c10d::", "_sum_add_norm_kernel")),
    ("attention", ("_decode_split_kernel", "_prefill_kernel", "_shared_prefix_decode_kernel", "_store_kvcache_kernel",
                   "_seal_pages_kernel", "attention", "flash", "scaled_dot_product")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "_skinny_gemm_kernel", "_fp8_gemm_kernel",
              "_quant_act_kernel", "_quant_rows_kernel", "_invariant_matmul_kernel", "_gate_up_kernel", "_down_kernel",
              "splitk", "sm90_", "sm80_", "ampere_", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::_scaled_mm")),
    ("sampling", ("_sample_", "_filter_floor_kernel", "_logprob_", "_apply_penalties_kernel",
                  "_apply_token_bitmask_kernel", "aten::exponential", "aten::argmax", "aten::multinomial")),
    ("copies", ("memcpy", "memset")),
    ("norm/act/rope/elementwise", ("rms_norm", "_row_rstd_kernel", "silu", "rope", "rotary", "elementwise",
                                   "reduce_kernel", "index", "embedding", "copy", "fill", "softmax", "aten::")),
]
ORDER = [name for name, _ in CATEGORIES] + ["other"]
NOTES = {
    "attention": "decode / prefill / shared-prefix attention and the paged KV store (rope+store is under norm)",
    "gemm": "cuBLAS / cutlass / nvjet and our Triton GEMMs (skinny, FP8 with its activation quantisation, MoE)",
    "all-reduce": "NCCL (all-reduces, the logits' gather) / symmetric memory / the deferred sums' barriers and "
                  "sum+add+RMSNorm kernel, on rank 0, waits for other ranks included",
}


def row(name: str, value: str) -> None:
    print(f"## {name}: {value}", flush=True)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def breakdown(events: list[tuple[str, float, float, float]], steps: int, top: int = 3) -> dict:
    """events: (name, start us, end us, own us) of one device's kernels (GPU) or operators (CPU, own = self time).
    Returns per-step ms per category (with its top names), the busy time (union of intervals) and events per step."""
    per: dict[str, dict[str, list[float]]] = {c: {} for c in ORDER}
    for name, _, _, own in events:
        per[category(name)].setdefault(name, []).append(own)
    cats = {}
    for c in ORDER:
        names = sorted(per[c].items(), key=lambda kv: -sum(kv[1]))
        cats[c] = {
            "ms": sum(sum(v) for _, v in names) / steps / 1000,
            "events_per_step": sum(len(v) for _, v in names) / steps,
            "top": [{"name": n[:120], "ms": sum(v) / steps / 1000, "calls_per_step": len(v) / steps}
                    for n, v in names[:top]],
        }
    return {"categories": cats, "busy_ms": union_us([(a, b) for _, a, b, _ in events]) / steps / 1000,
            "events_per_step": len(events) / steps}


WORK = (None, "kernel", "gpu_memcpy", "gpu_memset")  # kineto's activity types of device work
NOT_WORK = ("gpu_user_annotation", "cuda_sync", "overhead")  # device-side spans that are not work of their own


def profile_events(prof, on_gpu: bool) -> tuple[list[tuple[str, float, float, float]], dict[str, int]]:
    """The profile's GPU kernels, copies and memsets (on a GPU; not its GPU-side annotations or sync spans) or its CPU
    operators (on CPU), as breakdown() takes them; and how many events of each activity type the device had."""
    cuda = torch.autograd.DeviceType.CUDA
    device = [e for e in prof.events() if (e.device_type == cuda) == on_gpu]
    types: dict[str, int] = {}
    for e in device:
        kind = str(getattr(e, "activity_type", None))
        types[kind] = types.get(kind, 0) + 1
    keep = [e for e in device if not on_gpu or getattr(e, "activity_type", None) in WORK]
    if on_gpu and device and not keep:  # an activity type named otherwise: keep all but the known non-work spans
        print(f"WARNING: no GPU event of the expected activity types {WORK[1:]}: {types}", flush=True)
        keep = [e for e in device if getattr(e, "activity_type", None) not in NOT_WORK]
    if on_gpu:  # the profiler's GPU-side spans of c10d collectives, beside the NCCL kernels they wrap
        keep = [e for e in keep if not e.name.startswith("nccl:")]
    out = []
    for e in keep:
        start, end = e.time_range.start, e.time_range.end
        out.append((e.name, start, end, (end - start) if on_gpu else e.self_cpu_time_total))
    return out, types


def sync(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def model_dir(name: str, tmp: Path) -> str:
    from nvcli.models.presets import PRESETS, preset_dir

    if name in PRESETS:
        return str(preset_dir(name, tmp))
    if name.startswith("tiny-"):
        from nvcli.testing.tiny_models import make_tiny_model

        return str(make_tiny_model(tmp / name, name[len("tiny-"):], num_attention_heads=8, num_key_value_heads=4))
    if not Path(name).exists():
        raise SystemExit(f"--model {name!r}: not a preset ({', '.join(PRESETS)}), tiny-<arch> or a directory")
    return name


def design_max_model_len(path: str) -> int:
    """4096 as the DESIGN workload, or the model's positions if fewer."""
    cfg = Path(path) / "config.json"
    positions = json.loads(cfg.read_text()).get("max_position_embeddings", 4096) if cfg.exists() else 4096
    return min(4096, positions)


def engine_args(args) -> dict:
    kw = dict(tensor_parallel_size=args.tp, max_model_len=args.max_model_len, max_num_seqs=max(args.max_num_seqs,
              args.batch), max_num_batched_tokens=args.max_num_batched_tokens, load_format=args.load_format,
              device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization, num_kvcache_blocks=args.num_kvcache_blocks)
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg {item!r}: expected KEY=VALUE (an EngineConfig field)")
        try:
            kw[key] = json.loads(value)
        except json.JSONDecodeError:
            kw[key] = value
    return kw


def reach_decode(engine, batch: int, budget: int, prompt_len: int) -> int:
    """Step until no request waits and a step is decode-only (every request decoding); returns the steps taken."""
    cap = 2 * math.ceil(batch * prompt_len / budget) + 50
    for n in range(1, cap + 1):
        before = engine.stats().num_decode_steps
        engine.step()
        s = engine.stats()
        if s.num_waiting == 0 and s.num_decode_steps > before:
            if s.num_running != batch:
                raise SystemExit(f"only {s.num_running} of {batch} requests are running (finished: "
                                 f"{s.num_finished}); raise max_model_len or lower --batch")
            return n
    s = engine.stats()
    raise SystemExit(f"not every request was decoding after {cap} steps: {s.num_running} running, {s.num_waiting} "
                     f"waiting, {s.num_preemptions} preemptions, {s.kv_blocks_used}/{s.kv_blocks_total} KV blocks "
                     "used; the KV cache may be too small for --batch x --prompt-len: lower them")


def queue_prompts(engine, args, rng: random.Random) -> int:
    """Queue enough one-token requests of --prompt-len random ids for every prompt step the phase times and profiles
    to carry a full --max-num-batched-tokens (chunked prefill fills each step); returns the tokens per step."""
    from nvcli.sampling_params import SamplingParams

    one = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
    for i in range(requests(args, engine.config.max_num_batched_tokens)):
        engine.add_request([rng.randint(0, 10000) for _ in range(args.prompt_len)], one, request_id=f"profile-{i}")
    return engine.config.max_num_batched_tokens


def requests(args, budget: int) -> int:
    """How many requests the phase adds: --batch decoding ones, or enough prompts to fill every prompt step."""
    if args.phase == "decode":
        return args.batch
    return math.ceil((args.warm_steps + 2 * args.steps + args.profile_steps + 2) * budget / args.prompt_len)


def timed(engine, steps: int, on_gpu: bool, sync_each: bool, prompt_tokens: int = 0) -> dict:
    """Wall ms per step over `steps` steps, the device synchronised at both ends (and after each step with
    `sync_each`); the engine's own host phases per step; checks that every step was a decode step of the same batch
    (or, with `prompt_tokens`, a prompt step of that many tokens)."""
    s0 = engine.stats()
    host = []
    sync(on_gpu)
    t0 = time.perf_counter()
    for _ in range(steps):
        a = time.perf_counter()
        engine.step()
        if sync_each:
            sync(on_gpu)
        host.append(time.perf_counter() - a)
    sync(on_gpu)
    wall = (time.perf_counter() - t0) / steps
    s1 = engine.stats()
    if prompt_tokens:
        if s1.num_decode_steps != s0.num_decode_steps or s1.prompt_tokens - s0.prompt_tokens != steps * prompt_tokens:
            print(f"WARNING: the window was not {steps} prompt steps of {prompt_tokens} tokens "
                  f"({s1.num_decode_steps - s0.num_decode_steps} decode steps, "
                  f"{s1.prompt_tokens - s0.prompt_tokens} prompt tokens)", flush=True)
    elif s1.num_decode_steps - s0.num_decode_steps != steps or s1.num_running != s0.num_running:
        print(f"WARNING: the window was not {steps} decode steps of {s0.num_running} requests "
              f"({s1.num_decode_steps - s0.num_decode_steps} decode steps, {s1.num_running} running, "
              f"{s1.num_preemptions - s0.num_preemptions} preemptions)", flush=True)
    return {"wall_ms": 1000 * wall, "step_call_ms_median": 1000 * statistics.median(host),
            "schedule_ms": 1000 * (s1.schedule_s - s0.schedule_s) / steps,
            "collect_ms": 1000 * (s1.execute_s - s0.execute_s) / steps,
            "postprocess_ms": 1000 * (s1.postprocess_s - s0.postprocess_s) / steps,
            "preemptions": s1.num_preemptions - s0.num_preemptions}


def run(args) -> dict:
    from nvcli.config import EngineConfig
    from nvcli.engine.llm_engine import LLMEngine

    tmp = Path(tempfile.mkdtemp(prefix="nv-step-profile-"))
    path = model_dir(args.model, tmp)
    if args.max_model_len is None:
        args.max_model_len = design_max_model_len(path)
    config = EngineConfig(model=path, **engine_args(args))
    if config.data_parallel_size > 1:
        raise SystemExit("data parallelism runs replicas in other processes: profile one replica (no --dp)")
    on_gpu = config.resolved_device() == "cuda"
    if on_gpu:
        row("device", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}")
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    row("engine", f"{args.model} TP={args.tp} on {config.resolved_device()}, ready in {time.perf_counter() - t0:.1f} s,"
        f" {engine.stats().kv_blocks_total} KV blocks of {engine.config.kvcache_block_size} tokens, "
        f"CUDA graphs {'off' if config.enforce_eager or not on_gpu else 'on'}, "
        f"async scheduling {engine.async_scheduling}")
    try:
        return measure(args, engine, on_gpu)
    finally:
        drain(engine, requests(args, engine.config.max_num_batched_tokens))
        engine.shutdown()


def drain(engine, count: int) -> None:
    """Abort the requests and step until nothing is in flight, so that no rank is mid-step at shutdown."""
    try:
        for i in range(count):
            engine.abort(f"profile-{i}")
        for _ in range(1000):
            if not engine.has_unfinished():
                return
            engine.step()
    except Exception as e:  # noqa: BLE001 - reported; shutdown still runs
        print(f"WARNING: draining the engine failed: {type(e).__name__}: {e}", flush=True)


def measure(args, engine, on_gpu: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from nvcli.sampling_params import SamplingParams

    warm = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8)
    engine.add_request(list(range(100, 116)), warm, request_id="warm-up")
    while engine.has_unfinished():
        engine.step()
    max_len = engine.max_model_len
    if args.prompt_len >= max_len:
        raise SystemExit(f"--prompt-len {args.prompt_len} leaves no room below max_model_len {max_len}")
    rng = random.Random(0)
    gen0 = engine.stats().generation_tokens
    if args.phase == "prompt":
        tokens = queue_prompts(engine, args, rng)
        what, rate = f"prompt step, {tokens} tokens", "prompt tok/s"
    else:
        tokens = 0
        sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_len - args.prompt_len)
        for i in range(args.batch):
            engine.add_request([rng.randint(0, 10000) for _ in range(args.prompt_len)], sp, request_id=f"profile-{i}")
        t0 = time.perf_counter()
        n = reach_decode(engine, args.batch, engine.config.max_num_batched_tokens, args.prompt_len)
        row("prefill", f"{n} steps to every request decoding ({time.perf_counter() - t0:.2f} s)")
        what, rate = f"decode step, batch {args.batch}", "tok/s"
    for _ in range(args.warm_steps):
        engine.step()
    piped = timed(engine, args.steps, on_gpu, sync_each=False, prompt_tokens=tokens)
    serial = timed(engine, args.steps, on_gpu, sync_each=True, prompt_tokens=tokens)
    per_step = tokens or args.batch
    row(f"{what}, pipelined", f"{piped['wall_ms']:.3f} ms/step wall ({args.steps} steps, synchronised at both ends; "
        f"{1000 * per_step / piped['wall_ms']:,.0f} {rate}); host in step(): schedule {piped['schedule_ms']:.3f}, "
        f"collect (waits included) {piped['collect_ms']:.3f}, postprocess {piped['postprocess_ms']:.3f} ms/step")
    row(f"{what}, synchronised after each", f"{serial['wall_ms']:.3f} ms/step wall (no host/device overlap)")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    context = args.prompt_len + (0 if tokens else (engine.stats().generation_tokens - gen0) / args.batch)
    sync(on_gpu)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        sync(on_gpu)
    prof_wall = 1000 * (time.perf_counter() - t0) / args.profile_steps
    if args.trace:
        prof.export_chrome_trace(args.trace)
        row("trace", args.trace)
    events, types = profile_events(prof, on_gpu)
    bd = breakdown(events, args.profile_steps, args.top)
    if on_gpu and not events:
        print("WARNING: the profile holds no GPU kernel: kernels replayed from CUDA graphs were not traced on this "
              "setup; rerun with --enforce-eager", flush=True)
    wall = piped["wall_ms"]
    what = "GPU kernels" if on_gpu else "CPU operators (self time)"
    row(f"profiled ({args.profile_steps} steps, rank 0)", f"{prof_wall:.3f} ms/step wall under the profiler, "
        f"{bd['events_per_step']:.0f} {what} per step, busy {bd['busy_ms']:.3f} ms/step, "
        f"~{context:.0f} tokens of context per request")
    for c in ORDER:
        d = bd["categories"][c]
        tops = "; ".join(f"{t['name'][:60]} {t['ms']:.3f} ms x{t['calls_per_step']:.0f}" for t in d["top"])
        row(f"{c}", f"{d['ms']:.3f} ms/step, {d['events_per_step']:.0f} per step" + (f" [{tops}]" if tops else ""))
    return {
        "model": args.model, "tp": args.tp, "phase": args.phase, "batch": args.batch, "prompt_tokens": tokens,
        "prompt_len": args.prompt_len,
        "context_tokens_per_request": context, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__, "engine_args": {k: v for k, v in engine_args(args).items() if v is not None},
        "cuda_graphs": on_gpu and not args.enforce_eager, "steps": args.steps, "profile_steps": args.profile_steps,
        "wall_ms": wall, "wall_sync_each_ms": serial["wall_ms"], "wall_profiled_ms": prof_wall,
        "host_phases_ms": {k: piped[k] for k in ("schedule_ms", "collect_ms", "postprocess_ms",
                                                 "step_call_ms_median")},
        "preemptions": piped["preemptions"] + serial["preemptions"], "busy_ms": bd["busy_ms"],
        "host_idle_ms": wall - bd["busy_ms"], "events_per_step": bd["events_per_step"], "units": what,
        "device_event_types": types,
        "categories": bd["categories"],
    }


def table(res: dict) -> str:
    wall = res["wall_ms"]

    def line(name: str, ms: float, note: str = "") -> str:
        return f"| {name} | {ms:.3f} | {100 * ms / wall:.1f}% | {note} |"

    step = (f"prompt steps of {res['prompt_tokens']} tokens ({res['prompt_len']}-token prompts)"
            if res["phase"] == "prompt" else
            f"batch {res['batch']}, ~{res['context_tokens_per_request']:.0f}-token contexts")
    graphs = "on" if res["cuda_graphs"] else "off"
    head = f"{res['model']} TP={res['tp']}, {step}, {res['device']}, CUDA graphs {graphs}; {res['units']} of rank 0"
    out = [head, "", "| category | ms/step | % of wall | what |", "| --- | --- | --- | --- |"]
    out += [line(c, res["categories"][c]["ms"], NOTES.get(c, "")) for c in ORDER]
    out.append(line("GPU busy" if res["device"] != "cpu" else "busy", res["busy_ms"],
                    "union of intervals (categories may overlap, e.g. copies beside kernels)"))
    out.append(line("host / idle", res["host_idle_ms"], "wall - busy"))
    out.append(line("wall", wall, f"pipelined, {res['steps']} steps; {res['wall_sync_each_ms']:.3f} ms synchronised "
                    f"after each step"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", help="preset, tiny-<arch> or a model directory")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--phase", choices=("decode", "prompt"), default="decode",
                    help="decode: steady decode steps of --batch requests; prompt: prompt steps of "
                         "--max-num-batched-tokens tokens each (one-token requests of --prompt-len)")
    ap.add_argument("--batch", type=int, default=256, help="requests decoding together (--phase decode)")
    ap.add_argument("--prompt-len", type=int, default=600, help="random token ids per prompt")
    ap.add_argument("--steps", type=int, default=20, help="steps timed (twice: pipelined, synchronised)")
    ap.add_argument("--profile-steps", type=int, default=10, help="steps profiled")
    ap.add_argument("--warm-steps", type=int, default=3, help="steps before timing")
    ap.add_argument("--top", type=int, default=3, help="kernel names listed per category")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 4096 (or the model's positions)")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--num-kvcache-blocks", type=int, default=None)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="any other EngineConfig field (VALUE parsed as JSON, else a string); repeatable")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the numbers as JSON")
    ap.add_argument("--trace", default=None, metavar="PATH", help="write the profile as a Chrome trace")
    args = ap.parse_args(argv)
    for flag in ("batch", "prompt_len", "steps", "profile_steps", "tp"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
        row("json", args.json)
    print()
    print(table(res), flush=True)


if __name__ == "__main__":
    main()
