"""Quality of a quantised KV cache against a reference one: teacher-forced logits, greedy agreement.

Used by tests/engine/test_fp8_kv_cache.py and benchmarks/fp8_quality.py. `teacher_forced_logits`
drives a ModelRunner directly (one packed prefill, then one batched decode step per token), so
both caches see exactly the same token sequences. It writes KV blocks behind the block manager's
back: call it on an engine with prefix caching off, or on one no request will run on afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvcli.engine.model_runner import ModelRunner
from nvcli.engine.step_input import StepInput


def teacher_forced_logits(runner: ModelRunner, prompts: list[list[int]],
                          continuations: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, float32 logits [len(continuation), vocab] on the CPU: row i predicts continuation[i].

    The prompt is prefilled in one step (all sequences packed together), then continuation[:-1]
    is fed one token per decode step, every still-running sequence batched.
    """
    bs = runner.block_size
    tables: list[list[int]] = []
    next_block = 0
    for p, c in zip(prompts, continuations):
        assert p and c, "every sequence needs a prompt and at least one continuation token"
        n = -(-(len(p) + len(c)) // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    if next_block > runner.num_kvcache_blocks:
        raise ValueError(f"needs {next_block} KV blocks, the runner has {runner.num_kvcache_blocks}")

    def slot(s: int, pos: int) -> int:
        return tables[s][pos // bs] * bs + pos % bs

    ids, positions, slots, qsl = [], [], [], [0]
    for s, p in enumerate(prompts):
        ids += p
        positions += range(len(p))
        slots += [slot(s, i) for i in range(len(p))]
        qsl.append(qsl[-1] + len(p))
    logits = runner.forward_logits(StepInput(ids, positions, slots, qsl, [len(p) for p in prompts], tables, False))
    out: list[list[torch.Tensor]] = [[row.cpu()] for row in logits]
    for j in range(max(len(c) for c in continuations) - 1):
        live = [s for s, c in enumerate(continuations) if j + 1 < len(c)]
        pos = [len(prompts[s]) + j for s in live]
        step = StepInput([continuations[s][j] for s in live], pos, [slot(s, q) for s, q in zip(live, pos)],
                         list(range(len(live) + 1)), [q + 1 for q in pos], [tables[s] for s in live], True)
        logits = runner.forward_logits(step)
        for s, row in zip(live, logits):
            out[s].append(row.cpu())
    return [torch.stack(rows) for rows in out]


@dataclass
class LogitStats:
    max_abs_logit: float  # max |logit_test - logit_ref| over every position and vocab entry
    max_abs_logprob_top: float  # max |logprob diff| of the reference's argmax token
    mean_kl: float  # mean KL(ref || test) per position, nats
    top1_agree: float  # fraction of positions whose argmax matches


def compare_logits(ref: list[torch.Tensor], test: list[torch.Tensor]) -> LogitStats:
    """Stats over every position of every sequence (float64 math, one sequence at a time)."""
    max_logit = max_lp = kl = agree = 0.0
    n = 0
    for r, t in zip(ref, test):
        r, t = r.double(), t.double()
        lr, lt = r.log_softmax(-1), t.log_softmax(-1)
        top = r.argmax(-1, keepdim=True)
        max_logit = max(max_logit, float((r - t).abs().max()))
        max_lp = max(max_lp, float((lr.gather(-1, top) - lt.gather(-1, top)).abs().max()))
        kl += float((lr.exp() * (lr - lt)).sum(-1).sum())
        agree += float((t.argmax(-1) == top[:, 0]).sum())
        n += r.shape[0]
    return LogitStats(max_logit, max_lp, kl / max(n, 1), agree / max(n, 1))


@dataclass
class Agreement:
    exact: int  # sequences identical token for token
    total: int
    prefix_frac: float  # mean over sequences of (tokens equal before the first divergence) / length


def greedy_agreement(ref: list[list[int]], test: list[list[int]]) -> Agreement:
    fracs = []
    for a, b in zip(ref, test):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        fracs.append(n / max(len(a), len(b), 1))
    return Agreement(sum(a == b for a, b in zip(ref, test)), len(ref), sum(fracs) / max(len(fracs), 1))


def kv_amax(runner: ModelRunner) -> tuple[float, float]:
    """Largest |K| and |V| the runner's cache holds (unwritten slots are zero): offline calibration."""
    cache = runner.kv_cache  # [2, num_layers, num_blocks, block_size, kv_heads, head_dim]
    k = max(float(cache[0, i].abs().max()) for i in range(cache.shape[1]))
    v = max(float(cache[1, i].abs().max()) for i in range(cache.shape[1]))
    return k, v
