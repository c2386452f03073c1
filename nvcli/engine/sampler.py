"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

On the GPU every batch goes to the fused inverse-CDF kernels (kernels/sampling.py), whose noise is keyed per row;
where a row uses top-k / top-p / min-p, they are one floor per row (kernels/sampling_filters.py, found without a
sort), and the kernels drop the columns below it as they read them (a row without filters has floor -inf, so its draw
is unchanged). On the CPU sampling uses the exponential-race form of Gumbel-max:
argmax(p / q) with q ~ Exp(1) picks token i with probability p_i. Either way a seeded row draws from its own seed mixed
with the output position, so a seeded request gets the same tokens whatever shares its batch.

`logit_bias` comes first, then the penalties (presence, frequency, repetition; engine/penalties.py), vLLM V1's order
(its Sampler applies the min-tokens and logit-bias logits processors, then the penalties): a batch with a biased or a
penalized row samples from a float32 copy of its logits, those rows rewritten in it (the bias added by one
accumulating index_put_ over its (row, token) pairs). Every other row of that copy is its exact float32 conversion
(the fused kernels convert to float32 as they load anyway), so its draw is the one it would be without its
neighbours. `min_tokens`: until a row has that many output tokens, its EOS and stop token ids are set to -inf
before sampling (vLLM's min-tokens logits processor), so they are never drawn; vLLM sets them before the bias and the
penalties, which leave -inf as it is, so setting them last here is the same. Logprobs stay those of the model's own
logits. Temperatures below 1e-5 are greedy, as in vLLM (dividing by them overflows).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from nvcli.engine.penalties import PenaltyBatch, apply_penalties
from nvcli.kernels.ops import use_triton
from nvcli.outputs import FlatLogprobs
from nvcli.uploads import upload

_MASK = float("-inf")


@dataclass
class RowValues:
    """A batch's per-row sampling values on the host, as the device takes them: SamplingBatch.build uploads them for
    the eager sampler, and small decode steps copy them into their sampler graphs' inputs (engine/sampler_graphs.py),
    so a row draws the same token either way."""

    temperatures: list[float]  # 0 = greedy
    top_k: list[int] | None  # capped at the vocab size, which also stands for none; None if no row uses it
    top_p: list[float] | None  # 1 = none; None if no row uses it
    min_p: list[float] | None  # 0 = none; None if no row uses it
    seeds: list[tuple[int, int]]  # (row, seed mixed with the output position) for seeded sampled rows
    philox: list[int] | None  # each row's noise seed (the fused GPU sampler); None when all greedy or without rng

    @property
    def all_greedy(self) -> bool:
        return all(t == 0 for t in self.temperatures)

    @property
    def filtered(self) -> bool:
        """Some row uses top-k, top-p or min-p."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @staticmethod
    def of(params: list, positions: list[int], vocab_size: int, rng: random.Random | None) -> RowValues:
        """`params`: SamplingParams per row; `positions`: index of the token being sampled. `rng` draws the noise
        seeds of unseeded rows, one draw per row whatever the row (a seeded row's is not used)."""
        temps = [0.0 if p.greedy else p.temperature for p in params]
        sampled = any(t > 0 for t in temps)
        top_k = top_p = min_p = None
        if sampled:
            if any(p.top_k > 0 for p in params):
                top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
            if any(p.top_p < 1.0 for p in params):
                # float32 of a top_p below ~1e-45 is 0; filter_floors keeps the most likely token whatever top_p is
                top_p = [p.top_p for p in params]
            if any(p.min_p > 0 for p in params):
                min_p = [p.min_p for p in params]
        seeds = [
            (i, (p.seed * 1_000_003 + pos) & 0x7FFF_FFFF_FFFF_FFFF)
            for i, (p, pos, t) in enumerate(zip(params, positions, temps))
            if p.seed is not None and t > 0
        ]
        philox = None
        if rng is not None and sampled:
            by_row = dict(seeds)
            philox = [by_row.get(i, rng.getrandbits(62)) for i in range(len(params))]
        return RowValues(temps, top_k, top_p, min_p, seeds, philox)


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
    banned: list[tuple[int, tuple[int, ...]]] | None = None  # (row, token ids it must not draw): min_tokens
    penalties: PenaltyBatch | None = None  # the rows that sample with penalties; None if none does
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # ([K] int64 rows, [K] int64 token ids): logit_bias
    bias_values: torch.Tensor | None = None  # [K] float32: what each (row, token) pair adds

    @staticmethod
    def build(params: list, positions: list[int], vocab_size: int, device: torch.device,
              rng: random.Random | None = None,
              banned: list[tuple[int, tuple[int, ...]]] | None = None,
              penalties: PenaltyBatch | None = None) -> SamplingBatch:
        """`params`: SamplingParams per row; `positions`: index of the token being sampled.

        `rng` draws the noise seeds of unseeded rows (the fused GPU sampler); seeded rows mix
        their seed with the output position instead. `banned`: (row, token ids) the row must not draw.
        `penalties`: the penalized rows and their token history (engine/penalties.py, PenaltySlots.prepare).
        Each row's `logit_bias` goes to the device here, as (row, token, bias) triples in one upload.
        """
        values = RowValues.of(params, positions, vocab_size, rng)
        all_greedy = values.all_greedy

        def to(v: list | None, dtype: torch.dtype) -> torch.Tensor | None:
            return None if v is None else upload(torch.tensor(v, dtype=dtype), device)

        bias_index = bias_values = None
        biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if biased:
            k = sum(len(b) for _, b in biased)
            rows = np.repeat(np.array([i for i, _ in biased], dtype=np.int64), [len(b) for _, b in biased])
            tokens = np.fromiter(chain.from_iterable(b.keys() for _, b in biased), dtype=np.int64, count=k)
            amounts = np.fromiter(chain.from_iterable(b.values() for _, b in biased), dtype=np.float32, count=k)
            packed = np.concatenate([rows.view(np.uint8), tokens.view(np.uint8), amounts.view(np.uint8)])
            dev = upload(torch.from_numpy(packed), device)  # one copy: int64 [2, K], then float32 [K]
            index = dev[: 16 * k].view(torch.int64).view(2, k)
            bias_index, bias_values = (index[0], index[1]), dev[16 * k :].view(torch.float32)
        return SamplingBatch(
            # all greedy: argmax needs no temperatures, and a token's latency pays for every upload
            temperatures=None if all_greedy else to(values.temperatures, torch.float32),
            top_k=to(values.top_k, torch.int64), top_p=to(values.top_p, torch.float32),
            min_p=to(values.min_p, torch.float32), seeds=values.seeds, all_greedy=all_greedy,
            num_logprobs=[p.logprobs for p in params], philox_seeds=to(values.philox, torch.int64),
            needs_filter=values.filtered, banned=banned or None,
            penalties=penalties, bias_index=bias_index, bias_values=bias_values,
        )


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [num_seqs, vocab] (any float dtype; the fused kernel reads it as is) -> token ids [num_seqs] int64.
    The caller's logits are left as they are: they give the logprobs."""
    raw = logits
    if batch.bias_index is not None:
        logits = logits.to(torch.float32, copy=True)  # [num_seqs, vocab]; the other rows convert exactly
        logits.index_put_(batch.bias_index, batch.bias_values, accumulate=True)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)  # a float32 copy
    if batch.banned:
        if logits is raw:
            logits = logits.clone()
        for row, ids in batch.banned:
            logits[row, list(ids)] = _MASK
    if use_triton(logits) and batch.philox_seeds is not None:
        from nvcli.kernels.sampling import sample_triton

        # the fused kernels drop the columns below each row's floor as they read the logits: no filtered copy
        floors = filter_floors(logits, batch) if batch.needs_filter else None
        return sample_triton(logits, batch.temperatures, batch.philox_seeds, floors)
    greedy = logits.argmax(dim=-1)  # exact in any dtype
    if batch.all_greedy:
        return greedy
    logits = logits.float()
    probs = torch.softmax(_scaled(logits, batch.temperatures), dim=-1)
    if batch.needs_filter:
        probs = torch.where(kept_mask(logits, batch), probs, torch.zeros_like(probs))
    q = torch.empty_like(probs).exponential_(generator=generator)
    for row, seed in batch.seeds:
        g = torch.Generator(device=probs.device).manual_seed(seed)
        q[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
    sampled = (probs / q).argmax(dim=-1)
    return torch.where(batch.temperatures > 0, sampled, greedy)


def _scaled(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """logits / T per row (float32); greedy rows (T = 0) unscaled."""
    return logits.float() / torch.where(temps > 0, temps, torch.ones_like(temps)).unsqueeze(1)


def filter_floors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[num_seqs] float32: each row keeps the tokens whose logit is at or above its floor after top-k, then top-p (of
    the tempered distribution, renormalized over what top-k kept), then min-p; ties with the last kept token stay. The
    most likely token always stays, as in vLLM, even where top_p rounds to 0 in float32; greedy rows keep every token
    (their floor is -inf: argmax, whatever ties). kernels/sampling_filters.py finds them without a sort."""
    assert batch.temperatures is not None  # a batch with filters has a sampled row
    if use_triton(logits):
        from nvcli.kernels.sampling_filters import filter_floors_triton

        return filter_floors_triton(logits, batch.temperatures, batch.top_k, batch.top_p, batch.min_p)
    from nvcli.kernels.sampling_filters import filter_floors_reference

    return filter_floors_reference(logits, batch.temperatures, batch.top_k, batch.top_p, batch.min_p)


def kept_mask(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[num_seqs, vocab] bool: the tokens the filters leave each row (filter_floors)."""
    return logits.float() >= filter_floors(logits, batch).unsqueeze(1)


def logprob_rows(num_logprobs: list[int | None]) -> tuple[list[int], list[int]]:
    """The rows that asked for logprobs (SamplingParams.logprobs per row, None = not asked), and how many
    alternatives each asked for."""
    rows = [i for i, n in enumerate(num_logprobs) if n is not None]
    return rows, [num_logprobs[i] or 0 for i in rows]


def sampled_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], ks: list[int]
                           ) -> TokenLogprobs | None:
    """Logprob and rank of each sampled token of `rows` (and of its top ks alternatives) from the raw model logits,
    still on the device (`TokenLogprobs.flat` reads them); None without rows."""
    if not rows:
        return None
    if len(rows) == logits.shape[0]:  # every row (rows ascend): the logits as they are, no gathered copy
        return token_logprobs([logits], tokens, max(ks), logits.device)
    idx = upload(torch.tensor(rows, dtype=torch.int64), logits.device)
    return token_logprobs([logits[idx]], tokens[idx], max(ks), logits.device)


@dataclass
class TokenLogprobs:
    """Logprobs of given tokens, their ranks and each row's top k, in one int32 tensor (one copy to the host):
    [rows, 3 + 2k], per row the token id, its logprob (float32 bits), its rank, then k top logprobs (float32 bits)
    and their k ids, most likely first (kernels/token_logprobs.py writes it so)."""

    packed: torch.Tensor  # [rows, 3 + 2k] int32

    @property
    def k(self) -> int:
        return (self.packed.shape[1] - 3) // 2

    def columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views: (token_ids [rows] int32, chosen [rows] float32, ranks [rows] int32, top_values [rows, k] float32,
        top_ids [rows, k] int32)."""
        p, k = self.packed, self.k
        return p[:, 0], p[:, 1].view(torch.float32), p[:, 2], p[:, 3 : 3 + k].view(torch.float32), p[:, 3 + k :]

    def to_host(self) -> TokenLogprobs:
        """A copy in pinned host memory, enqueued on the current stream: read it once the stream has passed it
        (a step's event). Reading the device tensor instead would wait for every step launched after this one."""
        if self.packed.device.type != "cuda":
            return self
        host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
        host.copy_(self.packed, non_blocking=True)
        return TokenLogprobs(host)

    def flat(self, ks: Sequence[int] | np.ndarray) -> FlatLogprobs:
        """Per row, a position: the given token first, then its row's top ks[row] (vLLM's layout; the given token
        keeps its own rank where it is among them). Numpy columns: no per-token objects (a scoring job has millions of
        rows), and no Python lists until something reads them (outputs.FlatLogprobs)."""
        n = len(ks)  # rows past it: padding
        on_host = TokenLogprobs(self.packed[:n].cpu())
        token_ids, chosen, ranks, top_values, top_ids = (c.numpy() for c in on_host.columns())
        ks = np.asarray(ks)
        if not ks.any():  # copies: the columns are strided views of the (pinned) packed rows
            return FlatLogprobs(np.arange(n + 1, dtype=np.int64), token_ids.copy(), chosen.copy(), ranks.copy())
        width = self.k  # top_values, top_ids: [n, width] each
        # [n, 1 + width]: the given token, then the top ones; a top token equal to the given one is left out
        keep = np.concatenate([np.ones((n, 1), dtype=bool), (np.arange(width) < ks[:, None])
                               & (top_ids != token_ids[:, None])], axis=1)
        ids = np.concatenate([token_ids[:, None], top_ids], axis=1)
        values = np.concatenate([chosen[:, None], top_values], axis=1)
        all_ranks = np.concatenate([ranks[:, None], np.broadcast_to(np.arange(1, width + 1, dtype=np.int32),
                                                                    (n, width))], axis=1)
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(keep.sum(axis=1), out=starts[1:])
        return FlatLogprobs(starts, ids[keep], values[keep], all_ranks[keep])


def pack_columns(out: torch.Tensor, token_ids: torch.Tensor, chosen: torch.Tensor, ranks: torch.Tensor,
                 top_values: torch.Tensor, top_ids: torch.Tensor) -> None:
    """Write the columns into `out` [rows, 3 + 2k] int32, TokenLogprobs' layout (the torch path; the kernel writes
    the same layout itself)."""
    k = top_ids.shape[1]
    out[:, 0] = token_ids
    out[:, 1] = chosen.float().contiguous().view(torch.int32)
    out[:, 2] = ranks
    out[:, 3 : 3 + k] = top_values.float().contiguous().view(torch.int32)
    out[:, 3 + k :] = top_ids


def token_logprobs(logit_chunks: Iterable[torch.Tensor], token_ids: torch.Tensor | list[int], k: int,
                   device: torch.device) -> TokenLogprobs:
    """Log-softmax of each row's logits at `token_ids` [rows], the rank there (vLLM's: 1 + tokens strictly more
    likely) and the row's top k, for rows that come as chunks of logits [chunk, vocab] in order. On the GPU one kernel
    reads each chunk once (kernels/token_logprobs.py), top-k included: a scoring job runs this over every prompt
    token."""
    if not isinstance(token_ids, torch.Tensor):
        token_ids = upload(torch.tensor(token_ids, dtype=torch.int64), device)
    packed = torch.empty((token_ids.shape[0], 3 + 2 * k), dtype=torch.int32, device=device)
    a = 0
    for chunk in logit_chunks:
        targets = token_ids[a : a + chunk.shape[0]]  # [chunk]
        out = packed[a : a + chunk.shape[0]]  # [chunk, 3 + 2k]
        if use_triton(chunk):
            from nvcli.kernels.token_logprobs import logprob_and_rank_triton

            logprob_and_rank_triton(chunk, targets, k, out)
        else:
            x = chunk.float()  # [chunk, vocab]
            lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [chunk, 1]
            target = x.gather(1, targets.unsqueeze(1))  # [chunk, 1]
            ranks = (x > target).sum(dim=-1, dtype=torch.int32) + 1  # int32: an int64 count costs 3x on the CPU
            top_values, top_ids = x.topk(k, dim=-1)  # [chunk, k]
            pack_columns(out, targets, (target - lse).squeeze(1), ranks, top_values - lse, top_ids)
        a += chunk.shape[0]
    assert a == token_ids.shape[0], f"{a} rows of logits for {token_ids.shape[0]} tokens"
    return TokenLogprobs(packed)
