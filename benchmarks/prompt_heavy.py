"""A prompt-heavy JSONL job through the whole `nv generate` pipeline: can the host feed the GPU?

Long prompts and short outputs (classification, extraction, summaries) make prefill the job. On
an H100 the engine prefills Qwen3-0.6B at ~450k prompt tokens/s; every prompt first passes the
reader thread: JSON parse, chat template, tokenization. This script times both sides:

    PYTHONPATH=. python3 benchmarks/prompt_heavy.py --reader-only            # the reader alone (any machine)
    PYTHONPATH=. python3 benchmarks/prompt_heavy.py --repeats 3              # whole jobs, one engine (GPU)

Input kinds, the same prompts each time: `text` ({"prompt": str}, tokenized by the reader),
`chat` ({"messages": [...]}, template + tokenization), `ids` ({"prompt_token_ids": [...]}: no
tokenization, the GPU-bound reference), `echo` (a scoring job as lm-eval-harness sends it: /v1/completions with the
prompt's ids, echo, logprobs=1 and max_tokens 0; its output lines carry every prompt token's logprob), `score` (native
lines with prompt_logprobs 20, the most vLLM allows by default: a distillation job's top-20 targets for every prompt
token; `score-openai` the same as /v1/completions lines, in vLLM's OpenAI shape), and `engine`: the ids fed straight to the engine's step loop, no job
threads at all (what the engine alone does with them). Jobs run through `run_job` as the CLI runs them, on one
engine with the prefix cache off (repeats would otherwise hit it), kinds in turn per repeat.
"""

from __future__ import annotations

import argparse
import io
import json
import queue
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from nvcli.jobs.reader import InputReader
from nvcli.jobs.requests import Defaults
from nvcli.jobs.runner import JobOptions, run_job

SCORE_K = 20  # the score kind's prompt_logprobs

WORDS = ("the model reads every line of the input file and answers it with one line of output while the "
         "dashboard shows throughput and cache occupancy on the terminal for a batch of one million prompts").split()


def make_lines(tokenizer: Any, n: int, prompt_tokens: int, seed: int) -> dict[str, list[bytes]]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(prompt_tokens)]  # one token per word, about
        texts.append(" ".join(words) + f" {rng.randrange(1 << 30)}")
    ids = tokenizer(texts).input_ids
    line = lambda obj: (json.dumps(obj) + "\n").encode()  # noqa: E731
    return {
        "text": [line({"prompt": t}) for t in texts],
        "chat": [line({"messages": [{"role": "user", "content": t}]}) for t in texts],
        "ids": [line({"prompt_token_ids": i}) for i in ids],
        # lm-eval-harness's loglikelihood request: score the prompt, top-1 alternative for its greedy check
        "echo": [line({"custom_id": f"e{n}", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": i, "echo": True, "logprobs": 1, "max_tokens": 0}}) for n, i in enumerate(ids)],
        # a distillation job's scoring line: every prompt token's logprob and its SCORE_K most likely alternatives
        "score": [line({"prompt_token_ids": i, "prompt_logprobs": SCORE_K}) for i in ids],
        # the same through vLLM's OpenAI shape ({token_id: {"logprob", "rank", "decoded_token"}} per position)
        "score-openai": [line({"custom_id": f"s{n}", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": i, "prompt_logprobs": SCORE_K, "max_tokens": 1}})
                         for n, i in enumerate(ids)],
    }


class _CountingEngine:
    """The reader's side of LLMEngine (its own tokenizing methods), with no model behind it."""

    from nvcli.engine.llm_engine import LLMEngine

    encode = LLMEngine.encode
    encode_batch = LLMEngine.encode_batch
    render_chat_text = LLMEngine.render_chat_text

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 1 << 30
        self.prompt_tokens = 0

    def add_request(self, prompt: Any, sampling_params: Any, request_id: str | None = None,
                    prompt_text: str | None = None, priority: int = 0) -> str:
        self.prompt_tokens += len(self.encode(prompt) if isinstance(prompt, str) else list(prompt))
        return request_id or ""


class _Logs:
    """A job reporter that prints the job's log lines (a pool that failed, say) and no dashboard."""

    def update(self, progress: Any) -> None:
        pass

    def log(self, message: str) -> None:
        print(f"job: {message}", flush=True)


def reader_rate(tokenizer: Any, lines: list[bytes]) -> tuple[float, float]:
    """(lines/s, prompt tokens/s) of the reader thread feeding an engine that costs nothing."""
    engine = _CountingEngine(tokenizer)
    events: queue.Queue = queue.Queue()
    reader = InputReader(lines, engine, Defaults(sampling={"max_tokens": 1}), events,
                         threading.Semaphore(len(lines) + 1), {})
    t0 = time.perf_counter()
    reader.start()
    reader.join()
    dt = time.perf_counter() - t0
    return len(lines) / dt, engine.prompt_tokens / dt


def engine_job(engine: Any, prompts: list[list[int]], max_tokens: int, prompt_logprobs: int | None = None
               ) -> tuple[float, float]:
    """The same prompts straight into the engine's step loop (no reader, writer or dashboard threads): how fast
    the engine alone turns them over, and where the host's time goes. Returns (seconds, prompt tok/s)."""
    from nvcli.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    before = step_counters(engine)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(ids, sp, f"e{i}")
    done = 0
    while engine.has_unfinished():
        done += len(engine.step())
    dt = time.perf_counter() - t0
    assert done == len(prompts)
    tokens = sum(map(len, prompts))
    print(f"engine: {dt:.2f} s, {tokens / dt:,.0f} prompt tok/s; {step_split(engine, before, dt)}", flush=True)
    return dt, tokens / dt


def kernel_profile(engine: Any, prompts: list[list[int]], max_tokens: int, prompt_logprobs: int | None, top: int
                   ) -> None:
    """One engine job under torch.profiler: the device's costliest kernels, and its busy time against the wall."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = engine_job(engine, prompts, max_tokens, prompt_logprobs)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
    print(f"under the profiler: wall {wall:.2f} s, device busy {busy:.2f} s (kernels and copies, summed)")
    print(events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70))


def step_counters(engine: Any) -> tuple[int, float, float, float]:
    return engine.num_steps, engine.schedule_s, engine.execute_s, engine.postprocess_s


def step_split(engine: Any, before: tuple[int, float, float, float], wall: float) -> str:
    """Where the engine thread's time went since `before`: its steps, then everything else."""
    steps, sched, execute, post = (a - b for a, b in zip(step_counters(engine), before))
    return (f"{steps} steps, {wall / max(steps, 1) * 1e3:.1f} ms each: schedule {sched:.2f} s, waiting for the "
            f"device {execute:.2f} s, postprocess {post:.2f} s, the rest (launches, add_request, the job's own "
            f"work) {wall - sched - execute - post:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=8192)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kinds", default="ids,text,chat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reader-only", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--prompt-logprobs", default="none", metavar="K[,K...]",
                    help="score every prompt token (a perplexity job) with K alternatives, 'none' for no scoring; "
                         "a list runs the engine kind once per K; the engine kind alone times it")
    ap.add_argument("--format-workers", type=int, default=None, metavar="N",
                    help="processes formatting the lines with logprobs (the echo kind's), as `nv generate "
                         "--format-workers`; default: the CLI's default beside a GPU")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="after the timed repeats, run the engine kind once more (the last K) under cProfile and "
                         "print its N costliest functions")
    ap.add_argument("--cprofile-kind", default=None, metavar="KIND",
                    help="after the timed repeats, run that job kind (echo, score, ...) once more under cProfile "
                         "(top 25 functions by own time): every thread of the job's process under Python 3.12 and "
                         "later, whose cProfile sees them all, else the main thread, which also steps the engine")
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                    help="after the timed repeats, run the engine kind once more (the last K) under torch.profiler "
                         "and print its N costliest device kernels and the device's busy time")
    args = ap.parse_args()
    score = [None if k == "none" else int(k) for k in args.prompt_logprobs.split(",")]
    if args.reader_only and "engine" in args.kinds.split(","):
        ap.error("--reader-only times the reader, which the engine kind skips: leave it out of --kinds")

    from transformers import AutoTokenizer

    from nvcli.models.presets import preset_dir

    model_dir = preset_dir("qwen3-0.6b", Path(tempfile.mkdtemp(prefix="nv-preset-")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kinds = args.kinds.split(",")
    lines = make_lines(tokenizer, args.lines, args.prompt_tokens, seed=0)
    if "engine" in kinds and len(score) > 1:  # one engine row per K
        at = kinds.index("engine")
        kinds[at : at + 1] = [f"engine k={k}" for k in score]
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}

    if args.reader_only:
        for _ in range(args.repeats):
            for k in kinds:
                rows[k].append(reader_rate(tokenizer, lines[k]))
        print(f"\nreader thread alone, {args.lines} lines of ~{args.prompt_tokens} tokens (median of {args.repeats}):")
        print("| input | lines/s | prompt tok/s |\n| --- | --- | --- |")
        for k in kinds:
            print(f"| {k} | {statistics.median(r[0] for r in rows[k]):,.0f} "
                  f"| {statistics.median(r[1] for r in rows[k]):,.0f} |")
        return

    from nvcli.config import EngineConfig
    from nvcli.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", enable_prefix_caching=False,
                                    kv_cache_dtype=args.kv_cache_dtype,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    from nvcli.jobs.format_pool import default_workers

    workers = default_workers("cuda") if args.format_workers is None else args.format_workers
    opts = lambda: JobOptions(defaults=Defaults(sampling={"max_tokens": args.max_tokens, "ignore_eos": True}),  # noqa: E731
                              handle_sigint=False, format_workers=workers)
    run_job(engine, lines["ids"][:512], io.BytesIO(), opts())  # warm-up: prompt and decode shapes
    out_dir = Path(tempfile.mkdtemp(prefix="nv-prompt-heavy-"))  # each job's lines, overwritten by the next
    prompt_ids = [json.loads(line)["prompt_token_ids"] for line in lines["ids"]]
    for _ in range(args.repeats):
        for k in kinds:
            if k.startswith("engine"):
                k_score = score[0] if k == "engine" else (None if k.endswith("None") else int(k.split("=")[1]))
                rows[k].append(engine_job(engine, prompt_ids, args.max_tokens, k_score))
                continue
            before = step_counters(engine)
            with open(out_dir / "out.jsonl", "wb") as sink:  # a file, as `nv generate -o` writes (a BytesIO grown
                res = run_job(engine, lines[k], sink, opts(), _Logs())  # to a score job's 900 MB cost it 1.2 s)
            assert res.written == args.lines and res.failed == 0, (k, res.written, res.errors)
            rows[k].append((res.elapsed_s, res.prompt_tokens / res.elapsed_s))
            print(f"{k}: {res.elapsed_s:.2f} s, {res.prompt_tokens / res.elapsed_s:,.0f} prompt tok/s; "
                  f"{step_split(engine, before, res.elapsed_s)}; {res.formatted_apart} lines formatted by "
                  f"{workers} worker processes", flush=True)
    if args.cprofile:  # one more engine run, profiled: cProfile slows the host, so it stays out of the table
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(engine_job, engine, prompt_ids, args.max_tokens, score[-1])
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(args.cprofile)
        stats.sort_stats("cumulative").print_stats(args.cprofile)
    if args.cprofile_kind:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        with open(out_dir / "out.jsonl", "wb") as sink:
            res = prof.runcall(run_job, engine, lines[args.cprofile_kind], sink, opts(), _Logs())
        print(f"{args.cprofile_kind} under cProfile: {res.elapsed_s:.2f} s, {res.formatted_apart} lines formatted apart")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.kernel_profile:
        kernel_profile(engine, prompt_ids, args.max_tokens, score[-1], args.kernel_profile)
    print(f"\nwhole jobs, {args.lines} lines of ~{args.prompt_tokens} prompt + {args.max_tokens} output tokens, "
          f"kv {args.kv_cache_dtype} (median of {args.repeats}):")
    print(f"| input | s | prompt tok/s | vs {kinds[0]} |\n| --- | --- | --- | --- |")
    base = statistics.median(r[0] for r in rows[kinds[0]])
    for k in kinds:
        s = statistics.median(r[0] for r in rows[k])
        print(f"| {k} | {s:.2f} | {statistics.median(r[1] for r in rows[k]):,.0f} | {base / s:.2f}x |")


if __name__ == "__main__":
    main()
