"""Speculative decoding by prompt lookup (vLLM's `"method": "ngram"`): drafts from the sequence's own tokens.

Proposal. For a running sequence whose tokens are all known, find the longest suffix n-gram (n from
prompt_lookup_max down to prompt_lookup_min) that occurred earlier in its last WINDOW tokens (prompt + output), and
propose the k tokens that followed its most recent earlier occurrence. Where fewer than k follow before the end, the
match is read as a period and continued (a loop `a b c a b c a b` proposes `c a b c`); no match, no drafts.

Verification. The scheduler gives a sequence with drafts d1..dk a row of 1 + k tokens (its last known token, then
the drafts) and samples at every one of them, each with the sequence's own parameters and output position, exactly
as plain decoding would sample there. Sample s_i is drawn from the target distribution after the context and
d1..di. Drafts are accepted while s_i == d_(i+1); the step appends s_0..s_a, where a is the number accepted (the
accepted drafts, then the first sample that differs, or the bonus sample after all k).

Why the output is exactly the target's. An n-gram draft is a deterministic function of the context: a point-mass
proposal q = 1[d]. Speculative sampling accepts d with probability min(1, p(d) / q(d)) = p(d), and otherwise draws
from the residual norm(max(0, p - q)), which is p without d, renormalized. Sampling s ~ p and accepting when s == d
does the same: it accepts with probability p(d), and given a rejection s is distributed as p conditioned on s != d.
So each appended token has the target's conditional distribution, whatever the drafts: greedy gives the tokens of
plain decoding, and a seeded request gives the same tokens with and without speculation, because its draw at an
output position depends on its seed and that position only (engine/sampler.py), never on the batch or the step.
A draft model's greedy drafts (engine/draft_model.py) are a deterministic function of the context as well, so all
of this holds for them unchanged.

Logprobs. Every sample s_i comes from the target's logits at its own position, so a row with `logprobs` gets, for
each appended token, the logprob, rank and top alternatives of that token at that position from the row that
sampled it (the verify row's extra rows, then its own: ScheduledBatch.sample_rows): the values plain decoding reports
there, up to float rounding (the verify forward computes 1 + k query tokens per sequence, so its matmuls and
attention may round otherwise than a one-token step's).

Every row may speculate: each sampling feature makes a verify row sample at draft position i exactly as plain
decoding would sample there once d1..di are its tokens, and keeps nothing a rejection has to undo.
- Logprobs: every row, the verify row's extra ones included, reports them from its own position's logits (above).
- Penalties (repetition, presence, frequency): the row for draft position i reads the sequence's history plus
  d1..di (step-local history rows, a [rows, vocab] copy per verify step: engine/penalties.py), which is what plain
  decoding reads there whenever that row's sample is kept (d1..di were then accepted, so they are its tokens); the
  history then gains only the kept tokens (PenaltySlots.record).
- min_tokens: each row bans EOS and the stop token ids by its own output position (SamplingInputs.of), as plain
  decoding bans there; a draft that is a banned token at a banned position is never sampled, so it is rejected.
- Structured-output grammars: the row for draft position i is masked with the matcher's mask after d1..di
  (GrammarCompiler.step_mask: llguidance consumes the drafts tentatively and rolls them back), the mask plain
  decoding applies there once d1..di are kept. A draft the grammar refuses is masked out at the position that
  would accept it, so it is rejected, and the positions after it (or after an EOS draft, which ends the sequence
  where it is kept) get an all-ones mask: nothing sampled there is kept. A draft that completes the grammar ends
  the sequence where it is kept, as that token does in plain decoding. The matcher itself takes only kept tokens,
  each once and in order, and none past the token that ended the sequence (LLMEngine._collect). n-gram drafts are
  cut before the first refused one when proposed (GrammarState.allowed_prefix), since rows after it would be
  computed for nothing; a draft model's drafts are written after scheduling (engine/draft_model.py), so theirs are
  only masked.
- prompt_logprobs: a sequence drafts only while decoding (`room`), after every prompt position is computed, so all
  of its prompt_logit_spans are scheduled before its first verify row, and a recompute after preemption schedules
  none again (Sequence.needs_prompt_logits): verify rows and prompt logits never meet in one sequence's step.
Speculation runs only in steps with at most `disable_by_batch_size` running sequences (a full batch keeps the device
busy without them), and only for sequences whose recent drafts held: one whose last verify kept no draft pauses
drafting for 2, 4, ... 64 tokens (engine/spec_backoff.py). A verify step needs its sequences' last tokens known, so
the engine first collects the step in flight, and collects a verify step at once (engine/llm_engine.py): no async
overlap for those steps. The
rejected positions' KV slots hold garbage until later steps overwrite them; only blocks whose tokens are all
accepted are registered in the prefix cache (Scheduler.postprocess).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import numpy as np

from nvcli.engine.scheduler import PENDING, ScheduledBatch
from nvcli.engine.sequence import Sequence, SequenceStatus
from nvcli.engine.spec_backoff import Backoff
from nvcli.speculative import SpeculativeConfig

WINDOW = 4096  # the tokens a proposal searches: the sequence's last ones (host cost is linear in it)


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` drafts after `tokens` [n] int64: what followed the most recent earlier occurrence of its longest
    suffix n-gram, n_min <= n <= n_max (continued periodically where the sequence ends first); [] without one."""
    n = len(tokens)
    if k < 1 or n < n_min + 1:
        return []
    # j: end of an earlier occurrence (j <= n - 2, so a token follows it); grown backwards one token at a time
    cand = np.flatnonzero(tokens[:-1] == tokens[-1])
    best, best_len = cand, 1
    for m in range(1, n_max):
        cand = cand[cand >= m]
        cand = cand[tokens[cand - m] == tokens[n - 1 - m]]
        if not cand.size:
            break
        best, best_len = cand, m + 1
    if best_len < n_min or not best.size:
        return []
    j = int(best[-1])
    drafts = tokens[j + 1 : j + 1 + k].tolist()
    period = n - 1 - j
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - period])
    return drafts


class _TokenArray:
    """A sequence's token ids as int64, synced by copying only the ids appended since the last proposal: the ids
    before a proposal's length never change afterwards (a verify step rewrites only positions after it)."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n > len(self.buf):
            grown = np.empty(max(n, 2 * len(self.buf)), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if n > self.n:
            self.buf[self.n : n] = token_ids[self.n : n]
        self.n = n
        return self.buf[:n]


class Proposer:
    """What every proposer shares: which steps speculate (`wants`), which sequences may draft now, and how many
    drafts fit (`room`). `propose` runs before the step is scheduled; `fill` after, on the scheduled batch."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, block_size: int, no_draft_at_page_end: bool
                 ) -> None:
        """`no_draft_at_page_end`: a cache whose full pages are sealed (fp8: kernels/kv_layout.py) is never written
        again in a sealed page, so a draft (which may be rejected and rewritten later) never takes a page's last
        slot there."""
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.no_draft_at_page_end = no_draft_at_page_end
        self.backoff = Backoff()

    def wants(self, running: list[Sequence]) -> bool:
        """Whether the next step may speculate (then the engine collects the step in flight first)."""
        return (0 < len(running) <= self.config.disable_by_batch_size
                and not all(self.backoff.paused(seq) for seq in running))

    def room(self, seq: Sequence) -> int:
        """How many drafts `seq` may verify in the next step: 0 unless it is decoding with its last token known;
        drafts stop where max_tokens or max_model_len would end the sequence anyway."""
        if (seq.status != SequenceStatus.RUNNING or seq.num_computed_tokens != seq.num_tokens - 1
                or seq.token_ids[-1] == PENDING or self.backoff.paused(seq)):
            return 0
        num_tokens = seq.num_tokens
        room = min(self.config.k, self.max_model_len - num_tokens - 1)  # the last sampled index stays < max_model_len
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_completion_tokens - 1)
        if self.no_draft_at_page_end:  # drafts sit at positions num_tokens .. num_tokens + room - 1
            room = min(room, self.block_size - 1 - num_tokens % self.block_size)
        return max(room, 0)

    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        raise NotImplementedError

    def fill(self, batch: ScheduledBatch) -> None:
        """Write the drafts of `batch`'s verify rows where `propose` left placeholders (nothing to do by default)."""


class NgramProposer(Proposer):
    """The engine's proposer: drafts for the running sequences of the next step (`propose`)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, block_size: int, no_draft_at_page_end: bool
                 ) -> None:
        super().__init__(config, max_model_len, block_size, no_draft_at_page_end)
        self._arrays: WeakKeyDictionary[Sequence, _TokenArray] = WeakKeyDictionary()

    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        """seq_id -> drafts, for the decoding sequences whose last token is known; those without a match are left out.
        Drafts stop where max_tokens or max_model_len would end the sequence anyway, and before the first one a
        constrained sequence's grammar refuses."""
        cfg = self.config
        out: dict[int, list[int]] = {}
        for seq in running:
            room = self.room(seq)
            if room < 1:
                continue
            array = self._arrays.get(seq)
            if array is None:
                array = self._arrays[seq] = _TokenArray()
            tokens = array.sync(seq.token_ids)
            drafts = propose_ngram(tokens[-WINDOW:], room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)  # type: ignore[arg-type]
            if drafts and seq.grammar is not None:  # a draft the constraint refuses (and all after it) is never kept
                drafts = drafts[: seq.grammar.allowed_prefix(drafts)]
            if drafts:
                out[seq.seq_id] = drafts
                self.backoff.proposed(seq, seq.num_tokens, drafts)
        return out
