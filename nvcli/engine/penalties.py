"""Sampling penalties (vLLM's `apply_penalties`) and the token history they read, kept on the device.

For a row that samples with penalties, over the float32 logits:

    mask = prompt_mask | output_mask   (the token is in the prompt / among the tokens generated so far)
    logits = where(mask, where(logits > 0, logits / repetition, logits * repetition), logits)
    logits -= frequency * output_counts
    logits -= presence * output_mask

`PenaltySlots` keeps what that needs per sequence in rank 0's ModelRunner: a slot of `counts` (each token's
occurrences in the output) and, once a row has repetition_penalty != 1, of `seen` (prompt_mask | output_mask itself,
kept up to date rather than recombined every step: a step of rows that only have repetition_penalty, as a model's
generation_config gives every request, reads one bool row per sequence and no counts). A step adds its sampled tokens
to both on the device, from the sampled tensor itself: with async scheduling the host schedules (and launches) step
N+1 before it has read step N's tokens, so a history rebuilt from host tokens would miss them, and rebuilding it every
step would cost a [rows, vocab] upload per step. Nothing is allocated until a row samples with penalties.

Speculative decoding (engine/spec_decode.py). A verify sequence with drafts d1..dk samples at k + 1 rows: the row
for draft position i samples the token after d1..di, so its counts and seen mask must be the sequence's history plus
d1..di (its own row: plus all k). A step where some penalized row verifies therefore reads step-local history rows,
one per penalized sampling row: the slot's row gathered, then its drafts added (`_verify_batch`); the slots
themselves are left alone until `record`, which adds only the tokens the step keeps (the samples up to and including
the first that differs from its draft, as Scheduler._accept keeps them), decided on the device from the sampled
tensor: no host sync, as for a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nvcli.engine.scheduler import PENDING
from nvcli.engine.verify_rows import first_extra_rows
from nvcli.kernels.ops import use_triton
from nvcli.uploads import upload

if TYPE_CHECKING:
    from nvcli.engine.sequence import Sequence
    from nvcli.sampling_params import SamplingParams


@dataclass
class PenaltyBatch:
    """The rows of one step that sample with penalties, their settings, and the history they read."""

    rows: torch.Tensor  # [P] int64: batch rows, ascending
    slots: torch.Tensor  # [P] int64: each row's slot in counts / seen
    presence: torch.Tensor | None  # [P] float32; None where every row's is 0
    frequency: torch.Tensor | None  # [P] float32; None where every row's is 0
    repetition: torch.Tensor | None  # [P] float32; None where every row's is 1
    counts: torch.Tensor  # [slots, vocab] int32: occurrences of each token in a slot's output so far
    # [slots, vocab] bool: tokens in a slot's prompt or output so far; passed where repetition is. A slot whose
    # sequence has repetition_penalty 1 may hold a stale row: x / 1 and x * 1 leave its logits as they are.
    seen: torch.Tensor | None
    all_rows: bool = False  # rows is every row of the batch (0, 1, ...): no gather or scatter of logit rows
    flat_base: torch.Tensor | None = None  # [P] int64: slots * vocab, where `record` adds each row's token
    ones: torch.Tensor | None = None  # [P] int32: what `record` adds
    # a step with verify rows: counts / seen above are its step-local rows (slots = 0 .. P - 1), and `record` writes
    # the pool through this instead
    verify: VerifyRecord | None = None


@dataclass
class VerifyRecord:
    """Where `record` adds the tokens a verify step keeps. The S samples of the step's penalized sequences, grouped
    per sequence in the order they follow one another (a verify sequence's extra rows, then its own row)."""

    counts: torch.Tensor  # [slots, vocab] int32: the pool's
    seen: torch.Tensor | None  # [slots, vocab] bool: the pool's, where the step has rows with repetition_penalty
    rows: torch.Tensor  # [S] int64: the batch row of each sample
    next_draft: torch.Tensor  # [S] int64: the draft a sample must equal for the next one to be kept; -1 after the last
    group_first: torch.Tensor  # [S] int64: the index (in S) of its sequence's first sample, which is always kept
    flat_base: torch.Tensor  # [S] int64: the sequence's slot * vocab


def apply_penalties(logits: torch.Tensor, penalties: PenaltyBatch) -> torch.Tensor:
    """logits [num_seqs, vocab] -> a float32 copy with the penalized rows penalized; every other row is its exact
    float32 conversion (bf16 and fp16 convert exactly), so what a sampler reads of it is what it read of `logits`."""
    if use_triton(logits):
        from nvcli.kernels.penalties import apply_penalties_triton

        # every row is written by the kernel where all are penalized; otherwise the others keep their conversion
        out = (torch.empty(logits.shape, dtype=torch.float32, device=logits.device) if penalties.all_rows
               else logits.to(torch.float32, copy=True))
        apply_penalties_triton(logits, out, penalties.rows, penalties.slots, penalties.counts,
                               penalties.seen if penalties.repetition is not None else None,
                               penalties.presence, penalties.frequency, penalties.repetition)
        return out
    if penalties.all_rows:
        out = None
        x = logits.float()  # [num_seqs, vocab]; only read: every op below makes a new tensor
    else:
        out = logits.to(torch.float32, copy=True)  # [num_seqs, vocab]; a copy even when already float32
        x = out.index_select(0, penalties.rows)  # [P, vocab]
    if penalties.repetition is not None:
        assert penalties.seen is not None
        seen = penalties.seen.index_select(0, penalties.slots)  # [P, vocab]
        rep = penalties.repetition.unsqueeze(1)  # [P, 1]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if penalties.frequency is not None or penalties.presence is not None:
        counts = penalties.counts.index_select(0, penalties.slots)  # [P, vocab] int32
        if penalties.frequency is not None:
            x = x - penalties.frequency.unsqueeze(1) * counts
        if penalties.presence is not None:
            x = x - penalties.presence.unsqueeze(1) * (counts > 0)
    if out is None:
        assert x is not logits  # SamplingParams.has_penalties: some op above ran
        return x
    return out.index_copy_(0, penalties.rows, x)


class PenaltySlots:
    """Per-sequence token history on the device for the sequences that sample with penalties (rank 0 only).

    A sequence gets a slot the first time it is a sampling row of a launched step; the slot is reclaimed once the
    sequence has finished and a new sequence needs one (the pool doubles when none is free). A preempted sequence
    keeps its slot: it keeps its generated tokens across the recompute, so its history stays valid.
    """

    def __init__(self, device: torch.device, initial_slots: int = 16) -> None:
        self.device = device
        self.initial_slots = initial_slots
        self.counts: torch.Tensor | None = None  # [slots, vocab] int32
        # [slots, vocab] bool: prompt or output tokens; once a row has repetition_penalty != 1
        self.seen: torch.Tensor | None = None
        self._slot_of: dict[int, int] = {}  # seq_id -> slot
        self._holder: list[Sequence | None] = []  # slot -> the sequence holding it
        self._free: list[int] = []  # free slots, the lowest last (popped first)
        self._last: PenaltyBatch | None = None  # the last step's batch, and what it was built from
        self._last_key: tuple | None = None

    @property
    def num_slots(self) -> int:
        return len(self._holder)

    def slots_for(self, held: int) -> int:
        """The pool's size once `held` sequences hold slots at once (it starts at initial_slots and doubles)."""
        slots = self.initial_slots
        while slots < held:
            slots *= 2
        return slots

    @property
    def num_held(self) -> int:
        return len(self._slot_of)

    def slot_of(self, seq: Sequence) -> int | None:
        return self._slot_of.get(seq.seq_id)

    def prepare(self, seqs: list[Sequence], sample_index: list[int], vocab_size: int,
                num_drafts: list[int] | None = None) -> PenaltyBatch | None:
        """The penalized sampling rows of a step about to sample (None if it has none), giving each sequence new
        to the pool a slot and initializing it on the device. Rows with sample_index -1 (a prompt chunk that does not
        end its prompt) sample nothing the engine keeps, so they neither read nor get a slot. `num_drafts`: the
        batch's (ScheduledBatch.num_drafts; empty or None without verify rows)."""
        rows: list[int] = []
        slots: list[int] = []
        new: list[Sequence] = []
        drafted: list[tuple[int, int]] = []  # per new sequence: where its drafts sit in token_ids (not its history)
        for row, (seq, index) in enumerate(zip(seqs, sample_index)):
            if index < 0 or not seq.sampling_params.has_penalties:
                continue
            slot = self._slot_of.get(seq.seq_id)
            if slot is None:
                slot = self._assign(seq, vocab_size)
                new.append(seq)
                k = num_drafts[row] if num_drafts else 0
                drafted.append((index - k, index) if k else (seq.num_tokens, seq.num_tokens))
            rows.append(row)
            slots.append(slot)
        if not rows:
            return None
        if new:
            self._initialize(new, drafted, vocab_size)
        params = [seqs[row].sampling_params for row in rows]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]
        uses_rep = any(r != 1 for r in repetition)
        assert self.counts is not None
        seen = self.seen if uses_rep else None
        if num_drafts and any(num_drafts[row] for row in rows):
            return self._verify_batch(seqs, sample_index, num_drafts, rows, slots, vocab_size, seen)
        # A decode step usually has the rows, slots and settings of the one before it: its device tensors serve again
        # (no upload; a token's latency pays for each one).
        key = (len(seqs), rows, slots, presence, frequency, repetition)
        last = self._last
        if last is not None and key == self._last_key and last.counts is self.counts and last.seen is seen:
            return last
        n = len(rows)
        packed = np.concatenate([np.array([rows, slots], dtype=np.int64).view(np.uint8).ravel(),
                                 np.array([presence, frequency, repetition], dtype=np.float32).view(np.uint8).ravel()])
        dev = upload(torch.from_numpy(packed), self.device)  # one copy: int64 [2, P], then float32 [3, P]
        ints = dev[: 16 * n].view(torch.int64).view(2, n)
        floats = dev[16 * n :].view(torch.float32).view(3, n)
        self._last_key = key
        self._last = PenaltyBatch(
            rows=ints[0], slots=ints[1],
            presence=floats[0] if any(presence) else None,
            frequency=floats[1] if any(frequency) else None,
            repetition=floats[2] if uses_rep else None,
            counts=self.counts, seen=seen, all_rows=n == len(seqs),
            flat_base=ints[1] * vocab_size, ones=torch.ones(n, dtype=torch.int32, device=self.device),
        )
        return self._last

    def _verify_batch(self, seqs: list[Sequence], sample_index: list[int], num_drafts: list[int], rows: list[int],
                      slots: list[int], vocab_size: int, seen: torch.Tensor | None) -> PenaltyBatch:
        """A step where some penalized row verifies drafts (module docstring): one step-local history row per
        penalized sampling row, in ascending batch row order. The row for a verify sequence's draft position i
        (extra row i, or its own row for i = k) reads its slot's row plus d1..di."""
        assert self.counts is not None
        extra = first_extra_rows(len(seqs), num_drafts)  # sequence i's extra rows: extra[i] .. extra[i + 1] - 1
        local_rows: list[int] = []  # batch row of each local row
        src: list[int] = []  # the slot each local row starts from
        added: list[list[int]] = []  # the drafts each local row adds to it
        params: list[SamplingParams] = []  # each local row's
        rec_rows: list[int] = []  # VerifyRecord's fields, per sample
        next_draft: list[int] = []
        group_first: list[int] = []
        rec_base: list[int] = []
        drafts_of: dict[int, list[int]] = {}
        for row, slot in zip(rows, slots):
            k, index = num_drafts[row], sample_index[row]
            drafts = drafts_of[row] = seqs[row].token_ids[index - k : index]
            local_rows.append(row)
            src.append(slot)
            added.append(drafts)
            params.append(seqs[row].sampling_params)
            first = len(rec_rows)  # samples in order: the extra rows (draft positions 0 .. k-1), then the own row
            rec_rows.extend([*range(extra[row], extra[row] + k), row])
            next_draft.extend([*drafts, -1])
            group_first.extend([first] * (k + 1))
            rec_base.extend([slot * vocab_size] * (k + 1))
        for row, slot in zip(rows, slots):  # the extra rows come after every own row, in batch order
            drafts = drafts_of[row]
            for i in range(len(drafts)):
                local_rows.append(extra[row] + i)
                src.append(slot)
                added.append(drafts[:i])
                params.append(seqs[row].sampling_params)
        n, s = len(local_rows), len(rec_rows)
        add_flat = [i * vocab_size + t for i, tokens in enumerate(added) for t in tokens]  # local row * vocab + token
        a = len(add_flat)
        ints = np.array(local_rows + src + add_flat + rec_rows + next_draft + group_first + rec_base, dtype=np.int64)
        floats = np.array([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                           [p.repetition_penalty for p in params]], dtype=np.float32)
        dev = upload(torch.from_numpy(np.concatenate([ints.view(np.uint8), floats.view(np.uint8).ravel()])),
                     self.device)  # one copy: int64 [2n + a + 4s], then float32 [3, n]
        at = [0, n, 2 * n, 2 * n + a, 2 * n + a + s, 2 * n + a + 2 * s, 2 * n + a + 3 * s, 2 * n + a + 4 * s]
        i64 = dev[: 8 * at[-1]].view(torch.int64)
        part = [i64[lo:hi] for lo, hi in zip(at, at[1:])]
        f32 = dev[8 * at[-1] :].view(torch.float32).view(3, n)
        counts = self.counts.index_select(0, part[1])  # [n, vocab] int32: a copy, the pool stays as it is
        counts.view(-1).index_add_(0, part[2], torch.ones(a, dtype=torch.int32, device=self.device))
        local_seen = None
        if seen is not None:
            local_seen = seen.index_select(0, part[1])  # [n, vocab] bool
            local_seen.view(-1).index_fill_(0, part[2], True)
        return PenaltyBatch(
            rows=part[0], slots=torch.arange(n, device=self.device),
            presence=f32[0] if floats[0].any() else None, frequency=f32[1] if floats[1].any() else None,
            repetition=f32[2] if seen is not None else None, counts=counts, seen=local_seen,
            all_rows=n == extra[-1],  # local rows ascend: all of them is 0 .. rows - 1
            verify=VerifyRecord(self.counts, seen, *part[3:]),
        )

    def record(self, penalties: PenaltyBatch, tokens: torch.Tensor) -> None:
        """Count each penalized row's sampled token (tokens [num_seqs] int64, on the device) in its slot, and mark it
        seen where the step has rows with repetition_penalty (a sequence with one is in every step it samples in).
        Enqueued on the device, no host sync: the next step's sampling, also enqueued, reads them after it."""
        if penalties.verify is not None:
            self._record_verify(penalties.verify, tokens)
            return
        base = penalties.flat_base if penalties.flat_base is not None else penalties.slots * penalties.counts.shape[1]
        ones = penalties.ones if penalties.ones is not None else torch.ones_like(base, dtype=torch.int32)
        flat = base + (tokens if penalties.all_rows else tokens.index_select(0, penalties.rows))  # [P]
        penalties.counts.view(-1).index_add_(0, flat, ones)
        if penalties.seen is not None:
            penalties.seen.view(-1).index_fill_(0, flat, True)

    @staticmethod
    def _record_verify(v: VerifyRecord, tokens: torch.Tensor) -> None:
        """A verify step's kept tokens into the pool: a sequence keeps its samples up to and including the first
        that differs from its draft (Scheduler._accept), so sample j is kept where every sample before it in its
        group equals its draft. Samples past that are added with weight 0 (counts) or redirected to the group's
        first sample, always kept, so every write of `seen` writes True (index_fill_ of repeated indices is then
        deterministic)."""
        sampled = tokens.index_select(0, v.rows)  # [S]
        miss = (sampled != v.next_draft).to(torch.int64)
        before = torch.cumsum(miss, 0) - miss  # misses before each sample, over all groups
        kept = before == before.index_select(0, v.group_first)  # none before it within its group
        flat = v.flat_base + sampled
        v.counts.view(-1).index_add_(0, flat, kept.to(torch.int32))
        if v.seen is not None:
            v.seen.view(-1).index_fill_(0, torch.where(kept, flat, flat.index_select(0, v.group_first)), True)

    # ------------------------------------------------------------------ slots
    def _assign(self, seq: Sequence, vocab_size: int) -> int:
        if seq.sampling_params.repetition_penalty != 1 and self.seen is None and self.counts is not None:
            self.seen = torch.zeros(self.counts.shape, dtype=torch.bool, device=self.device)
        if not self._free and not self._reclaim():
            self._grow(vocab_size, seq.sampling_params.repetition_penalty != 1)
        slot = self._free.pop()
        self._slot_of[seq.seq_id] = slot
        self._holder[slot] = seq
        return slot

    def _reclaim(self) -> int:
        """Free the slots of finished sequences; how many. Their last updates are already enqueued, before the
        re-initialization of a new holder, so the stream orders them."""
        freed = [slot for slot, seq in enumerate(self._holder) if seq is not None and seq.is_finished]
        for slot in reversed(freed):
            seq = self._holder[slot]
            assert seq is not None
            del self._slot_of[seq.seq_id]
            self._holder[slot] = None
            self._free.append(slot)
        return len(freed)

    def _grow(self, vocab_size: int, with_seen: bool) -> None:
        old = self.num_slots
        new = max(self.initial_slots, 2 * old)
        counts = torch.zeros((new, vocab_size), dtype=torch.int32, device=self.device)  # [slots, vocab]
        if self.counts is not None:
            counts[:old].copy_(self.counts)
        self.counts = counts
        if self.seen is not None or with_seen:
            seen = torch.zeros((new, vocab_size), dtype=torch.bool, device=self.device)  # [slots, vocab]
            if self.seen is not None:
                seen[:old].copy_(self.seen)
            self.seen = seen
        self._holder.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))

    def _initialize(self, seqs: list[Sequence], drafted: list[tuple[int, int]], vocab_size: int) -> None:
        """Zero the new slots and fill them from what the host knows, in one upload: the completion tokens already
        read back (none for a sequence new to the engine), less the drafts a verify row has at token_ids[lo:hi]
        (`drafted`; lo = hi otherwise), and, for repetition_penalty, the prompt's tokens too."""
        assert self.counts is not None
        slots = [self._slot_of[s.seq_id] for s in seqs]
        counted: list[np.ndarray] = []  # flat indices slot * vocab + token
        seen_ids: list[np.ndarray] = []  # flat indices of prompt and known output tokens
        seen_slots: list[int] = []
        for seq, slot, (lo, hi) in zip(seqs, slots, drafted):
            out = np.asarray(seq.token_ids[seq.num_prompt_tokens : lo] + seq.token_ids[hi:], dtype=np.int64)
            out = slot * vocab_size + out[out != PENDING]  # tokens still in flight: recorded when sampled
            if out.size:
                counted.append(out)
            if seq.sampling_params.repetition_penalty != 1:
                seen_ids.append(slot * vocab_size + np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype=np.int64))
                seen_ids.append(out)
                seen_slots.append(slot)
        n_counted = sum(a.size for a in counted)
        n_seen = len(seen_slots)
        packed = np.concatenate([np.asarray(slots, dtype=np.int64), *counted,
                                 np.asarray(seen_slots, dtype=np.int64), *seen_ids])
        dev = upload(torch.from_numpy(packed), self.device)
        at = len(slots)
        self.counts.index_fill_(0, dev[:at], 0)
        if n_counted:
            self.counts.view(-1).index_add_(0, dev[at : at + n_counted],
                                            torch.ones(n_counted, dtype=torch.int32, device=self.device))
        at += n_counted
        if n_seen:
            assert self.seen is not None
            self.seen.index_fill_(0, dev[at : at + n_seen], False)
            self.seen.view(-1).index_fill_(0, dev[at + n_seen :], True)
