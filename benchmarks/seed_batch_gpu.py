"""Does a seeded request draw the same tokens whatever else is in its batch, on the GPU?

    PYTHONPATH=. python3 benchmarks/seed_batch_gpu.py

A tiny random Qwen3 (the tests' model, Qwen3's vocabulary) generates one seeded row (top_k 50, temperature 1.0,
seed 1234) and one greedy row alone, then beside neighbours: the same neighbours with and without penalties, and a
batch of 31 plain seeded neighbours. Per dtype (float32, bfloat16) it prints, for each batch, the first token that
differs from the row's tokens alone and the largest difference of the sampled tokens' logprobs before it: logprobs
that move with the batch mean the logits do, before any sampling. The table is printed last.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from nvcli import LLM, SamplingParams
from nvcli.testing.tiny_models import make_tiny_model

TOKENS = 24
TARGETS = [(list(range(3000, 3023)), SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=TOKENS,
                                                       ignore_eos=True, logprobs=0)),
           (list(range(1000, 1005)), SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0))]


def neighbours(penalized: bool) -> list[tuple[list[int], SamplingParams]]:
    pen = {"frequency_penalty": 2.0} if penalized else {}
    pen2 = {"presence_penalty": 2.0, "repetition_penalty": 1.5} if penalized else {}
    return [(list(range(700, 740)), SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, **pen)),
            (list(range(800, 805)), SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, **pen2))]


def run(llm: LLM, batch: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch])
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [next(iter(d.values())).logprob if d else 0.0 for d in (c.logprobs or [])]))
    return result


def compare(alone: tuple[list[int], list[float]], other: tuple[list[int], list[float]]) -> str:
    (ta, la), (tb, lb) = alone, other
    first = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
    upto = len(ta) if first is None else first
    dev = max((abs(a - b) for a, b in zip(la[:upto], lb[:upto])), default=0.0)
    return f"{'same' if first is None else f'differs at {first}'}; max logprob diff before: {dev:.2e}"


def main() -> None:
    root = Path(tempfile.mkdtemp())
    model = make_tiny_model(root / "qwen3", "qwen3")
    table: list[tuple[str, str, str, str]] = []
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(model), device="cuda", dtype=dtype, max_model_len=256, num_kvcache_blocks=512)
        try:
            alone = [run(llm, [t])[0] for t in TARGETS]
            batches = {
                "plain neighbours": neighbours(False)[:1] + TARGETS[:1] + neighbours(False)[1:] + TARGETS[1:],
                "penalized neighbours": neighbours(True)[:1] + TARGETS[:1] + neighbours(True)[1:] + TARGETS[1:],
                "31 seeded neighbours": TARGETS + [
                    (list(range(5000 + 10 * i, 5010 + 10 * i)),
                     SamplingParams(temperature=0.7, seed=i, max_tokens=TOKENS, ignore_eos=True)) for i in range(30)],
            }
            for name, batch in batches.items():
                got = run(llm, batch)
                rows = [batch.index(t) for t in TARGETS]
                for label, a, r in zip(("seeded top_k 50", "greedy"), alone, rows):
                    table.append((dtype, name, label, compare(a, got[r])))
                    print(table[-1], flush=True)
        finally:
            llm.shutdown()
    print("\n| dtype | batch | row | against the row alone |\n| --- | --- | --- | --- |")
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
