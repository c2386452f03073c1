"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

On the GPU, batches without top-k / top-p / min-p go to the fused inverse-CDF kernels
(kernels/sampling.py), whose noise is keyed per row. Elsewhere sampling uses the
exponential-race form of Gumbel-max: argmax(p / q) with q ~ Exp(1) picks token i with
probability p_i. Either way a seeded row draws from its own seed mixed with the output
position, so a seeded request gets the same tokens whatever shares its batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from nvcli.engine.uploads import upload
from nvcli.kernels.ops import use_triton

_MASK = float("-inf")


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor | None  # [num_seqs] float32, 0 = greedy; None when every row is greedy
    top_k: torch.Tensor | None  # [num_seqs] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [num_seqs] float32; None if no row uses it
    min_p: torch.Tensor | None  # [num_seqs] float32; None if no row uses it
    seeds: list[tuple[int, int]]  # (row, seed mixed with the output position) for seeded rows
    all_greedy: bool
    num_logprobs: list[int | None]  # per row; None = not requested
    philox_seeds: torch.Tensor | None = None  # [num_seqs] int64 for the fused GPU sampler
    needs_filter: bool = False  # some row uses top-k / top-p / min-p

    @staticmethod
    def build(params: list, positions: list[int], vocab_size: int, device: torch.device,
              rng: random.Random | None = None) -> SamplingBatch:
        """`params`: SamplingParams per row; `positions`: index of the token being sampled.

        `rng` draws the noise seeds of unseeded rows (the fused GPU sampler); seeded rows mix
        their seed with the output position instead.
        """
        temps = [p.temperature for p in params]
        all_greedy = all(t == 0 for t in temps)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                                     dtype=torch.int64)
            if any(p.top_p < 1.0 for p in params):
                # float32 of a top_p below ~1e-45 is 0; _top_k_top_p keeps the most likely token whatever top_p is
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            if any(p.min_p > 0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        seeds = [
            (i, (p.seed * 1_000_003 + pos) & 0x7FFF_FFFF_FFFF_FFFF)
            for i, (p, pos) in enumerate(zip(params, positions))
            if p.seed is not None and p.temperature > 0
        ]

        def to(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else upload(t, device)

        philox = None
        if rng is not None and not all_greedy:
            by_row = dict(seeds)
            philox = torch.tensor([by_row.get(i, rng.getrandbits(62)) for i in range(len(params))], dtype=torch.int64)
        return SamplingBatch(
            # all greedy: argmax needs no temperatures, and a token's latency pays for every upload
            temperatures=None if all_greedy else to(torch.tensor(temps, dtype=torch.float32)),
            top_k=to(top_k), top_p=to(top_p), min_p=to(min_p), seeds=seeds, all_greedy=all_greedy,
            num_logprobs=[p.logprobs for p in params], philox_seeds=to(philox),
            needs_filter=top_k is not None or top_p is not None or min_p is not None,
        )


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [num_seqs, vocab] (any float dtype; the fused kernel reads it as is) -> token ids [num_seqs] int64."""
    if use_triton(logits) and batch.philox_seeds is not None and not batch.needs_filter:
        from nvcli.kernels.sampling import sample_triton

        return sample_triton(logits, batch.temperatures, batch.philox_seeds)
    greedy = logits.argmax(dim=-1)  # exact in any dtype
    if batch.all_greedy:
        return greedy
    logits = logits.float()
    temps = batch.temperatures
    scaled = logits / torch.where(temps > 0, temps, torch.ones_like(temps)).unsqueeze(1)
    if batch.top_k is not None or batch.top_p is not None:
        scaled = _top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if batch.min_p is not None:
        keep = probs >= batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    q = torch.empty_like(probs).exponential_(generator=generator)
    for row, seed in batch.seeds:
        g = torch.Generator(device=probs.device).manual_seed(seed)
        q[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
    sampled = (probs / q).argmax(dim=-1)
    return torch.where(temps > 0, sampled, greedy)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), _MASK)
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop = before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # the most likely token stays, as vLLM's does, even where top_p rounds to 0
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[dict[int, float] | None]:
    """Logprob of each sampled token (and the top-N alternatives) from the raw model logits."""
    rows = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
    out: list[dict[int, float] | None] = [None] * len(batch.num_logprobs)
    if not rows:
        return out
    token_ids = tokens.tolist()  # one device read, not one per row
    idx = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = logp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
    max_n = max(batch.num_logprobs[i] or 0 for i in rows)
    top_vals, top_ids = (logp.topk(max_n, dim=-1) if max_n else (None, None))
    for j, i in enumerate(rows):
        entry = {token_ids[i]: chosen[j]}
        n = batch.num_logprobs[i] or 0
        if n:
            for t, v in zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()):
                entry.setdefault(t, v)
        out[i] = entry
    return out
