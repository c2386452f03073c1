"""The host's work for prompt logprobs, without a device: one 16k-token step of a scoring job (16 lines of 1,024
prompt tokens, every token's logprob and its top K), from the step's packed kernel output to the output lines.

    .venv/bin/python benchmarks/logprobs_host_cpu.py [--k 20] [--shape native|echo] [--repeats 5]
    PYTHONPATH=<other tree> .venv/bin/python benchmarks/logprobs_host_cpu.py   # another tree's nvcli, same script

Three threads of work, each timed per step (median of the repeats):
- the engine's thread: the step's rows made into logprob columns (`TokenLogprobs.flat`), each line's rows appended
  to its sequence, the finished sequences' token texts;
- the job's main thread: pickling each finished line (its request and output) to a formatting process;
- a formatting process: unpickling and formatting each line (ms per line; the pool has 4 of them by default).
On the GPU a 16k-token step takes about 40-50 ms; the first two share the GIL with the step loop."""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import numpy as np
import torch

from nvcli.engine.sampler import TokenLogprobs
from nvcli.jobs import jsonio
from nvcli.jobs.format_pool import decode_only
from nvcli.jobs.formatting import FormatContext, result_line
from nvcli.jobs.requests import Defaults, parse_line
from nvcli.models.tokenizer import load_tokenizer
from nvcli.outputs import CompletionOutput, FlatLogprobs, RequestOutput
from nvcli.testing.tiny_models import QWEN_VOCAB, qwen_tokenizer_dir

try:
    from nvcli.models.tokenizer import vocabulary_texts
except ImportError:  # trees before session 42 kept it in the engine
    from nvcli.engine.llm_engine import vocabulary_texts  # type: ignore[attr-defined,no-redef]

ROWS, SEQ = 16384, 1024


def packed_step(k: int, prompts: torch.Tensor) -> TokenLogprobs:
    """The kernel's packed rows for a step over `prompts` [ROWS // SEQ, SEQ + 1]: each row's next token."""
    g = torch.Generator().manual_seed(0)
    packed = torch.empty((ROWS, 3 + 2 * k), dtype=torch.int32)
    packed[:, 0] = prompts[:, 1:].reshape(-1)
    packed[:, 1] = (-torch.rand(ROWS, generator=g) * 10).view(torch.int32)
    packed[:, 2] = torch.randint(1, 1000, (ROWS,), generator=g)
    packed[:, 3 : 3 + k] = (-torch.rand(ROWS, k, generator=g) * 10).sort(dim=1, descending=True).values.view(torch.int32)
    # distinct ids in a row, as a top-k has them
    packed[:, 3 + k :] = (torch.randint(0, 151_000, (ROWS, 1), generator=g) + 4_999 * torch.arange(k)) % 151_000
    return TokenLogprobs(packed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--shape", choices=["native", "echo"], default="native",
                    help="native: prompt_logprobs K; echo: lm-eval's /v1/completions echo with logprobs K")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dicts", action="store_true", help="format logprob lists as dicts (the job's way before session 43)")
    args = ap.parse_args()
    k = args.k
    tok = load_tokenizer(qwen_tokenizer_dir())
    vocab = vocabulary_texts(tok)
    prompts = torch.randint(0, 151_000, (ROWS // SEQ, SEQ + 1), generator=torch.Generator().manual_seed(1))
    step = packed_step(k, prompts)
    columnar = hasattr(FlatLogprobs, "use_vocabulary")  # this session's numpy columns
    reqs = []
    for p in prompts.tolist():
        body = ({"prompt_token_ids": p, "prompt_logprobs": k, "max_tokens": 1} if args.shape == "native" else
                {"custom_id": "c", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": p, "echo": True, "logprobs": k, "max_tokens": 0}})
        reqs.append(parse_line(json.dumps(body), 0, Defaults()))
    worker_ctx = FormatContext("model", tokenizer=decode_only(tok), created=0)
    if "vocabulary" in FormatContext.__dataclass_fields__:  # the job hands its workers the engine's table
        worker_ctx.vocabulary = vocab
    if "raw_json" in FormatContext.__dataclass_fields__:  # a job's lists serialized from the columns (session 43)
        worker_ctx.raw_json = jsonio.FRAGMENTS and not args.dicts
    times: dict[str, list[float]] = {}
    for r in range(args.repeats + 1):  # the first round warms up (and builds the worker's vocabulary)
        t = [time.perf_counter()]
        flat = step.flat(np.full(ROWS, k) if columnar else [k] * ROWS)
        t.append(time.perf_counter())
        seqs = []
        for s in range(ROWS // SEQ):
            seq = FlatLogprobs()
            seq.append_empty()
            seq.extend_from(flat, s * SEQ, (s + 1) * SEQ)
            seqs.append(seq)
        t.append(time.perf_counter())
        for seq in seqs:
            if columnar:
                seq.use_vocabulary(vocab)
            else:
                seq.decoded_tokens = [vocab[i] if i < len(vocab) else "" for i in seq.token_ids]
        t.append(time.perf_counter())
        blobs = [pickle.dumps((req, RequestOutput("r", None, p, [CompletionOutput(0, "", [], "length")], True,
                                                  prompt_logprobs=seq)), protocol=pickle.HIGHEST_PROTOCOL)
                 for req, p, seq in zip(reqs, prompts.tolist(), seqs)]
        t.append(time.perf_counter())
        size = sum(map(len, blobs))
        for blob in blobs:
            req, out = pickle.loads(blob)
            jsonio.dumps(result_line(req, out, worker_ctx))
        t.append(time.perf_counter())
        if r == 0:
            continue
        for name, a, b in (("flat", 0, 1), ("runs", 1, 2), ("texts", 2, 3), ("pickle", 3, 4), ("worker", 4, 5)):
            times.setdefault(name, []).append((t[b] - t[a]) * 1e3)
    m = {name: statistics.median(v) for name, v in times.items()}
    engine = m["flat"] + m["runs"] + m["texts"]
    print(f"prompt logprobs K={k}, {args.shape} lines, one {ROWS}-token step of {ROWS // SEQ} lines "
          f"(median of {args.repeats}; vocabulary {QWEN_VOCAB}):")
    print("| engine thread: columns / runs / texts | main thread: pickling | per step on the GIL | "
          "worker per line | pickled per line |\n| --- | --- | --- | --- | --- |")
    print(f"| {m['flat']:.1f} / {m['runs']:.1f} / {m['texts']:.1f} ms | {m['pickle']:.1f} ms | "
          f"{engine + m['pickle']:.1f} ms | {m['worker'] / len(blobs):.1f} ms | {size / len(blobs) / 1e3:.0f} KB |")


if __name__ == "__main__":
    main()
