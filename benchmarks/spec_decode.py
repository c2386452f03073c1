"""Speculative decoding by prompt lookup (`--speculative-config '{"method": "ngram", ...}'`): what it buys and costs.

Sections (`--sections`, comma-separated):
- `copy`: one request that copies a passage of real text ("Repeat this passage with one word changed: ...") on the
  default model (SmolLM2-135M-Instruct, real weights), greedy, with and without ngram speculation: end-to-end time,
  the speed-up, tokens per verify (1 + accepted drafts per sequence's verification) and whether the tokens match.
- `propose`: the proposer's host cost per sequence at a 4,096-token context.
- `verify`: the cost of an engine step whose N decoding sequences each verify k drafts (k = 1..4; drafts forced, the
  last token repeated, so nearly all are rejected and the shape stays put) against a plain decode step of the same N,
  on `--models` (presets with dummy weights, or `default` for the default model). Verify steps are collected at once
  (no async overlap), as the engine runs them. With `--draft PRESET` each model's rows are measured a second time
  with that draft model proposing the k drafts (its forwards included: the step a draft-model job runs).

    PYTHONPATH=. python3 benchmarks/spec_decode.py --device cpu                  # CPU: copy, propose, verify (default)
    PYTHONPATH=. python3 benchmarks/spec_decode.py --device cuda --sections copy,propose,verify \\
        --models qwen3-0.6b,qwen3-8b --batch-sizes 1,8,32                       # GPU
    PYTHONPATH=. python3 benchmarks/spec_decode.py --device cuda --sections verify --models qwen3-8b \
        --draft qwen3-0.6b --batch-sizes 1,8,32                                 # a 0.6B-shape draft for the 8B

Prints `## name: value` rows and a table per section.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from nvcli import LLM, SamplingParams
from nvcli.engine.scheduler import PENDING
from nvcli.engine.sequence import SequenceStatus
from nvcli.engine.spec_backoff import Backoff
from nvcli.engine.spec_decode import WINDOW, propose_ngram

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

PASSAGE = """\
The river town woke slowly on market days. Before dawn the bakers lit their ovens, and by the time the first boats \
touched the quay the smell of bread had reached the bridge. Farmers from the valley brought apples, cheese and \
bundles of firewood, and they set up their stalls in the same places their parents had used, so that a visitor who \
came back after twenty years could still find the honey seller beside the fountain.

The old bridge was the reason the town existed at all. For centuries it was the only crossing for a day's walk in \
either direction, and every cart, soldier and pilgrim on the road had to pass over it and pay a small toll. The toll \
house still stands at the eastern end, although nobody has collected a coin there since the railway arrived and the \
new iron bridge was built downstream.

In the afternoon the square grew quiet. Children ran between the empty stalls, the cafe owner stacked his chairs, \
and the church bell marked the hours for people who no longer needed it to know the time. When the evening boat \
left for the city, its horn echoed off the hills, and the town returned to the river and the long summer light."""


def copy_task(args: argparse.Namespace) -> None:
    messages = [{"role": "user", "content": "Repeat this passage with one word changed:\n\n" + PASSAGE}]
    params = SamplingParams(temperature=0, max_tokens=args.copy_tokens)
    rows = []
    outs = {}
    for name, spec in (("plain", None), ("ngram", SPEC)):
        llm = LLM(device=args.device, max_model_len=2048, speculative_config=spec, enable_prefix_caching=False)
        llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))  # warm-up
        times = []
        for _ in range(args.repeats):
            before = llm.stats()
            t0 = time.perf_counter()
            out = llm.chat(messages, params)[0]
            times.append(time.perf_counter() - t0)
        after = llm.stats()
        llm.shutdown()
        n = len(out.outputs[0].token_ids)
        verify_rows = after.spec_verify_rows - before.spec_verify_rows
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        outs[name] = out.outputs[0].token_ids
        rows.append((name, statistics.median(times), n, verify_rows, accepted, drafted))
    t_plain, t_spec = rows[0][1], rows[1][1]
    _, _, n, verify_rows, accepted, drafted = rows[1]
    print(f"## copy_prompt_words: {len(PASSAGE.split())}")
    print(f"## copy_output_tokens: {n}")
    print(f"## copy_plain_s: {t_plain:.3f}")
    print(f"## copy_ngram_s: {t_spec:.3f}")
    print(f"## copy_speedup: {t_plain / t_spec:.2f}")
    print(f"## copy_tokens_per_verify: {1 + accepted / max(1, verify_rows):.2f}")
    print(f"## copy_draft_acceptance: {accepted / max(1, drafted):.3f}")
    print(f"## copy_same_tokens: {outs['plain'] == outs['ngram']}")
    print("\n| run | seconds (median) | output tokens | tokens/s | verifications | accepted / drafted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, t, n, v, a, d in rows:
        print(f"| {name} | {t:.3f} | {n} | {n / t:.1f} | {v} | {a} / {d} |")


def propose_cost(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    cases = {"random": rng.integers(0, 150_000, WINDOW), "loop": np.tile(rng.integers(0, 150_000, 37), WINDOW // 37 + 1)[:WINDOW]}
    print("\n| context | us per proposal | drafts |")
    print("| --- | --- | --- |")
    for name, tokens in cases.items():
        tokens = tokens.astype(np.int64)
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            drafts = propose_ngram(tokens, 4, 2, 4)
        us = (time.perf_counter() - t0) / n * 1e6
        print(f"| {name} {WINDOW} tokens | {us:.1f} | {len(drafts)} |")
        print(f"## propose_us_{name}_{WINDOW}: {us:.1f}")


class _ForcedDrafts:
    """A proposer that always proposes k drafts (the last token repeated) for every decoding sequence."""

    def __init__(self, k: int) -> None:
        self.k = k

    def wants(self, running: list) -> bool:
        return bool(running)

    def propose(self, running: list) -> dict[int, list[int]]:
        return {s.seq_id: [s.token_ids[-1]] * self.k for s in running
                if s.status == SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens - 1
                and s.token_ids[-1] != PENDING}

    def fill(self, batch) -> None:
        """The drafts are written at propose."""


def _settle(engine, draft, k: int) -> None:
    """Steps until the draft model has computed every running sequence's known tokens but the last verify step's (a
    draft that just took over catches up over a few steps, each bounded by max_num_batched_tokens)."""
    for _ in range(200):
        engine.step()
        if all(draft._state(s).valid >= s.num_tokens - k - 2 for s in engine.scheduler.running):
            return
    raise RuntimeError("the draft model did not catch up")


def _timed_steps(engine, steps: int) -> float:
    """Median ms of `steps` engine steps (the first of a new shape untimed)."""
    engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def verify_cost(args: argparse.Namespace) -> None:
    from nvcli.models.presets import PRESETS, preset_dir

    def model_path(name: str) -> str:
        return str(preset_dir(name, Path(tempfile.mkdtemp(prefix="nv-preset-"))))

    table = []
    for model in args.models.split(","):
        engine_args: dict = dict(device=args.device, max_model_len=args.prompt_len + 1024, seed=0,
                                 max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False)
        if model in PRESETS:
            engine_args.update(model=model_path(model), load_format="dummy")
        elif model != "default":
            engine_args["model"] = model
        if args.draft:  # the draft speculates in steps of up to the largest batch measured
            engine_args["speculative_config"] = {"model": model_path(args.draft) if args.draft in PRESETS else args.draft,
                                                 "num_speculative_tokens": max(args.ks),
                                                 "disable_by_batch_size": max(args.batch_sizes)}
        llm = LLM(**engine_args)
        engine = llm.engine
        draft = engine.proposer
        for n in args.batch_sizes:
            rng = np.random.default_rng(n)
            for _ in range(n):
                engine.add_request(rng.integers(100, 20_000, args.prompt_len).tolist(),
                                   SamplingParams(temperature=0, max_tokens=1_000, ignore_eos=True))
            engine.proposer = None
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
                    engine.scheduler.waiting:
                engine.step()
            for _ in range(3):
                engine.step()
            ms = {}
            for k in [0, *args.ks]:
                engine.proposer = _ForcedDrafts(k) if k else None
                ms[k] = _timed_steps(engine, args.steps)
                print(f"## step_ms_{model}_n{n}_k{k}: {ms[k]:.2f}")
            table.append((model, n, ms))
            if draft is not None:
                ms = {0: ms[0]}
                engine.proposer = draft
                draft.backoff = Backoff(max_pause=0)  # verify every step, however few drafts hold (dummy weights)
                for k in args.ks:
                    draft.config = dataclasses.replace(draft.config, num_speculative_tokens=k)
                    _settle(engine, draft, k)
                    ms[k] = _timed_steps(engine, args.steps)
                    print(f"## step_ms_{model}_n{n}_draft_k{k}: {ms[k]:.2f}")
                table.append((f"{model} + {args.draft} draft", n, ms))
            engine.proposer = None
            for seq in list(engine.scheduler.running):
                engine.abort(seq.request_id)
            while engine.has_unfinished():
                engine.step()
        llm.shutdown()
    print("\n| model | sequences | plain decode step ms (median) | " + " | ".join(f"verify k={k} ms (x plain)" for k in args.ks)
          + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in args.ks) + " |")
    for model, n, ms in table:
        print(f"| {model} | {n} | {ms[0]:.2f} | " + " | ".join(f"{ms[k]:.2f} ({ms[k] / ms[0]:.2f}x)" for k in args.ks)
              + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--sections", default="copy,propose,verify")
    p.add_argument("--repeats", type=int, default=3, help="copy: timed runs per setting (median)")
    p.add_argument("--copy-tokens", type=int, default=400, help="copy: max_tokens")
    p.add_argument("--models", default="default",
                   help="verify: presets (qwen3-0.6b, qwen3-8b, ...), model directories, or default")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4])
    p.add_argument("--draft", default=None, help="verify: also measure with this draft model (a preset or a directory)")
    p.add_argument("--steps", type=int, default=20, help="verify: timed steps per setting (median)")
    p.add_argument("--prompt-len", type=int, default=512, help="verify: prompt tokens per sequence")
    args = p.parse_args()
    sections = args.sections.split(",")
    if "copy" in sections:
        copy_task(args)
    if "propose" in sections:
        propose_cost(args)
    if "verify" in sections:
        verify_cost(args)


if __name__ == "__main__":
    main()
