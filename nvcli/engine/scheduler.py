"""Continuous batching: which sequences run in the next step, and how many tokens each.

One policy for every step (no separate prefill and decode phases): running sequences come
first (a decode costs one token, an unfinished prompt gets the next chunk), then waiting ones
while the token budget, the sequence limit and the KV blocks allow. When a running sequence needs a
block and none is free, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed later (its generated tokens are kept).

`--scheduling-policy priority` (vLLM's) changes two choices, nothing else: waiting sequences are admitted lowest
(priority, arrival) first (waiting_queue.PriorityQueue), and the running sequence preempted is the one of the
highest (priority, arrival), wherever it is in the step; a preempted sequence waits at its priority's place.
Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from nvcli.engine.block_manager import BlockManager
from nvcli.engine.sequence import Sequence, SequenceStatus
from nvcli.engine.verify_rows import first_extra_rows
from nvcli.engine.waiting_queue import PriorityQueue, waiting_queue

PENDING = -1  # placeholder for a token the device has sampled but the host has not read yet
# --scheduling-policy priority: a sequence's urgency, lowest first (seq_id grows with arrival, so it breaks ties)
urgency = attrgetter("priority", "seq_id")


@dataclass
class ScheduledBatch:
    """One step's work. Scheduling already advanced each sequence as if the step had run:
    `num_computed_tokens` counts this step's tokens, and a sequence that samples this step has a
    PENDING placeholder at `sample_index` that postprocess fills with the real token."""

    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed this step, per sequence
    start: list[int] = field(default_factory=list)  # first token index computed, per sequence
    sample_index: list[int] = field(default_factory=list)  # token index sampled, or -1 (prompt chunk)
    is_decode_only: bool = False
    # prompt_logprobs: (batch index, first position, end position) of prompt positions whose logits this step keeps
    prompt_logit_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # Speculative decoding (engine/spec_decode.py): drafts verified per sequence (empty where no step has drafts).
    # A verify sequence's k drafts sit in its token_ids at sample_index - k .. sample_index - 1, and it samples at each
    # of them too: those k rows come after every sequence's own row, in batch order (first_extra_rows), and its own
    # row samples the last
    num_drafts: list[int] = field(default_factory=list)

    @property
    def num_single_token_rows(self) -> int:
        """Leading sequences that compute one token each (the scheduler puts them first)."""
        n = 0
        while n < len(self.num_new_tokens) and self.num_new_tokens[n] == 1:
            n += 1
        return n

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def first_extra_rows(self) -> list[int]:
        """Sequence i's extra rows are [i] .. [i + 1] - 1; the last entry is the step's sampling row count
        (engine/verify_rows.py)."""
        return first_extra_rows(len(self.seqs), self.num_drafts)

    def sample_rows(self) -> dict[int, tuple[int, int, int, int]]:
        """seq_id -> (own row, first sampled token index, first extra row, k): where the step sampled each token
        index of a sequence. Index first + m (m < k: a verify sequence's drafted positions) was sampled at row
        extra + m, every later index (the last, or a plain row's only one, k = 0) at the sequence's own row. The rows
        are SamplingInputs.of's; sample_index stays as scheduled (postprocess never rewrites it)."""
        extra = self.first_extra_rows()
        out: dict[int, tuple[int, int, int, int]] = {}
        for row, (seq, index) in enumerate(zip(self.seqs, self.sample_index)):
            k = extra[row + 1] - extra[row]
            out[seq.seq_id] = (row, index - k, extra[row], k)
        return out

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # fcfs: a deque, front first; priority: a heap, most urgent first (the same members; see waiting_queue.py)
        self.waiting: deque[Sequence] | PriorityQueue[Sequence] = waiting_queue(policy, urgency)
        self.by_priority = policy == "priority"
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prompt chunks that did not finish their prompt
        self.spec_draft_tokens = self.spec_accepted_tokens = self.spec_verify_rows = 0  # speculative decoding
        # Prompts being computed, by the hash their first uncached block will have: (sequence, that block's index). A
        # waiting prompt that would compute the same block instead waits a step or two and then reads it from the
        # prefix cache: a job whose lines share an instruction computes it once, and every sequence's table then
        # starts with the same pages, which decode reads once (kernels/shared_prefix_attention.py).
        self._computing: dict[int, tuple[Sequence, int]] = {}

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens, more than max_model_len={self.max_model_len}; "
                "shorten it or raise --max-model-len"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def schedule(self, drafts: dict[int, list[int]] | None = None) -> ScheduledBatch:
        """`drafts`: seq_id -> draft tokens of decoding sequences (engine/spec_decode.py); each verifies as many as
        the step's token budget holds."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False
        verify: dict[int, list[int]] = {}

        block_size = bm.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._done_pending(seq):
                i += 1  # its last token is still in flight and ends it: nothing more to compute
                continue
            uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            n = min(uncomputed, budget)
            if n < uncomputed and not self.enable_chunked_prefill:
                break
            proposed = drafts.get(seq.seq_id) if drafts else None
            if proposed:  # a decode (its last token known): 1 + drafts tokens, KV blocks for all of them
                proposed = proposed[: budget - n]
                n += len(proposed)
            # most steps of a decode stay inside its last block: nothing to allocate (can_allocate is then true)
            if seq.num_computed_tokens + n > len(seq.block_table) * block_size:
                while not bm.can_allocate(seq, n):
                    if self.by_priority:
                        victim, i, budget = self._preempt_least_urgent(i, seqs, counts, budget)
                    else:
                        victim = self.running[-1]
                        self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    if self.by_priority:
                        continue  # seq was the least urgent; the more urgent ones after it (now from i) still run
                    break  # seq preempted itself; everything after it is gone too
                bm.allocate(seq, n)
            if proposed:
                verify[seq.seq_id] = proposed
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1

        if len(self._computing) > 2 * self.max_num_seqs:  # forget the prompts whose blocks are registered
            for h in list(self._computing):
                self._being_computed(h)  # drops the entry unless its prompt still computes it
        # Admit waiting sequences, unless this step already had to give blocks back.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if PENDING in seq.token_ids[-2:]:
                break  # preempted while its token was in flight: readmit once the token is known
            # prompt_logprobs need every prompt position's logits: such a prompt is computed, not read from the cache (and
            # never waits for another prompt's blocks)
            fresh = seq.num_computed_tokens == 0 and not seq.needs_prompt_logits
            cached, first_miss = bm.lookup_prefix(seq) if fresh else ([], None)
            if first_miss is not None and self._being_computed(first_miss):
                break  # another prompt computes this block now: read it from the cache next step
            remaining = seq.num_tokens - len(cached) * bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                if seqs:
                    break
                raise RuntimeError("prompt exceeds max_num_batched_tokens and chunked prefill is off")
            if not bm.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            if cached or (bm.enable_prefix_caching and seq.num_computed_tokens == 0):
                bm.take_cached_prefix(seq, cached)  # also counts the query in the hit rate (no hit)
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            if first_miss is not None and n >= bm.block_size:
                self._computing[first_miss] = (seq, len(cached))

        return self._advance(seqs, counts, verify)

    def _being_computed(self, block_hash: int) -> bool:
        """Whether a running prompt is computing the block of this hash (and has not registered it yet)."""
        entry = self._computing.get(block_hash)
        if entry is None:
            return False
        seq, index = entry
        if seq.status == SequenceStatus.RUNNING and len(seq.block_hashes) <= index:
            return True
        self._computing.pop(block_hash, None)  # registered (now a cache hit), finished or preempted
        return False

    def _advance(self, seqs: list[Sequence], counts: list[int], drafts: dict[int, list[int]] | None = None
                 ) -> ScheduledBatch:
        # One-token rows first: a step that also carries prompt chunks runs its first rows through the decode
        # kernel, and the rest through the prefill kernel (AttentionMetadata.split).
        if any(n > 1 for n in counts):
            order = sorted(range(len(seqs)), key=lambda i: counts[i] > 1)  # stable
            seqs, counts = [seqs[i] for i in order], [counts[i] for i in order]
        batch = ScheduledBatch(seqs, counts)
        decode_only = bool(seqs)
        start, sample_index = batch.start, batch.sample_index
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            if seq.num_prompt_logprobs_scheduled < seq.num_prompt_logprobs_wanted:  # needs_prompt_logits
                lo = max(seq.num_computed_tokens, seq.num_prompt_logprobs_scheduled)
                hi = min(seq.num_computed_tokens + n, seq.num_prompt_logprobs_wanted)
                if hi > lo:
                    batch.prompt_logit_spans.append((i, lo, hi))
                    seq.num_prompt_logprobs_scheduled = hi
            computed = seq.num_computed_tokens
            start.append(computed)
            if drafts:  # the drafts are inputs of this step: in token_ids until postprocess keeps the accepted ones
                verified = drafts.get(seq.seq_id, ())
                seq.token_ids.extend(verified)
                batch.num_drafts.append(len(verified))
            seq.num_computed_tokens = computed = computed + n
            num_tokens = len(seq.token_ids)
            decode_only = decode_only and n == 1 and computed == num_tokens
            if computed == num_tokens:
                sample_index.append(num_tokens)
                seq.token_ids.append(PENDING)
            else:
                self.num_chunked_prefills += 1
                sample_index.append(-1)
        batch.is_decode_only = decode_only
        return batch

    def _done_pending(self, seq: Sequence) -> bool:
        """The in-flight token is the sequence's last one (max_tokens / max_model_len)."""
        if seq.token_ids[-1] != PENDING:
            return False
        sp = seq.sampling_params
        return (sp.max_tokens is not None and seq.num_completion_tokens >= sp.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        )

    def _preempt_least_urgent(self, i: int, seqs: list[Sequence], counts: list[int], budget: int
                              ) -> tuple[Sequence, int, int]:
        """Preempt the running sequence of the highest (priority, arrival), for the one at `i` that needs a block.
        It may be one this step has scheduled already (before `i`): it leaves the step, and its tokens go back to
        the budget (nothing of it has advanced yet: `_advance` runs once the step is complete). Returns the victim
        and `i` and `budget` as they now are. O(running) per preemption, as vLLM's; only a full cache gets here."""
        running = self.running
        j = max(range(len(running)), key=lambda k: urgency(running[k]))
        victim = running[j]
        if j < i:
            i -= 1
            for k, s in enumerate(seqs):
                if s is victim:  # not there if it was skipped (its last token in flight)
                    del seqs[k]
                    budget += counts.pop(k)
                    break
        self._preempt(victim)
        return victim, i, budget

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # fcfs: at the front; priority: at its (priority, arrival) place

    # ------------------------------------------------------------------ after the step
    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[tuple[Sequence, int]]:
        """Fill each sampled placeholder with its token and share newly full blocks; returns
        (sequence, token index) for each new token. A prompt chunk that leaves tokens uncomputed
        samples nothing."""
        produced: list[tuple[Sequence, int]] = []
        block_size = self.block_manager.block_size
        extra = batch.first_extra_rows()  # sequence i's earlier samples (a verify row's): extra[i] .. extra[i + 1] - 1
        for i, (seq, start, n, index, token) in enumerate(zip(batch.seqs, batch.start, batch.num_new_tokens,
                                                              batch.sample_index, sampled)):
            status = seq.status
            k = extra[i + 1] - extra[i]
            if k:  # a verify step is collected before the next schedule: its sequences run or have finished
                if status == SequenceStatus.RUNNING:
                    samples = sampled[extra[i] : extra[i + 1]] + [token]
                    accepted = self._accept(seq, index, samples)
                    n -= k - accepted
                    index -= k - accepted  # the last token kept; those from index - accepted on are new
                    token = samples[accepted]
                    produced.extend((seq, j) for j in range(index - accepted, index))
            if status == SequenceStatus.FINISHED:
                continue  # finished (stop, abort) while this step was in flight
            if index >= 0:
                seq.token_ids[index] = token
            # only a step that filled a block has one to register
            if status == SequenceStatus.RUNNING and (start + n) // block_size > len(seq.block_hashes):
                self.block_manager.register_computed_blocks(seq, start + n)
            if index >= 0:
                produced.append((seq, index))
        return produced

    def _accept(self, seq: Sequence, index: int, samples: list[int]) -> int:
        """A verify row's outcome: its drafts (token_ids[index - k : index]) are accepted while each equals the
        sample at its position; token_ids keep the accepted drafts and the sample after them (from samples, which
        equal them), whose KV is then what is computed. Returns the number accepted."""
        k = len(samples) - 1
        first = index - k
        accepted = 0
        while accepted < k and samples[accepted] == seq.token_ids[first + accepted]:
            accepted += 1
        del seq.token_ids[first + accepted + 1 :]  # postprocess writes the sample after them at first + accepted
        seq.num_computed_tokens -= k - accepted  # the rejected drafts' KV slots are garbage, rewritten later
        self.spec_draft_tokens += k
        self.spec_accepted_tokens += accepted
        self.spec_verify_rows += 1
        return accepted

    def check_stop(self, seq: Sequence, eos_token_ids: set[int], index: int | None = None) -> None:
        """Finish `seq` if the token at `index` (default: the last) ends it: EOS, stop id,
        max_tokens or max_model_len. Tokens after it (in flight) are dropped."""
        if index is None:
            index = seq.num_tokens - 1
        sp = seq.sampling_params
        token = seq.token_ids[index]
        n_out = index + 1 - seq.num_prompt_tokens
        if n_out >= sp.min_tokens:  # the sampler bans these tokens before (min_tokens_banned); checked here anyway
            if not sp.ignore_eos and token in eos_token_ids:
                return self.finish(seq, "stop", None, index)  # vLLM: stop_reason None for EOS
            if token in sp.stop_token_ids:
                return self.finish(seq, "stop", token, index)
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return self.finish(seq, "length", None, index)
        if index + 1 >= self.max_model_len:
            return self.finish(seq, "length", None, index)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               last_index: int | None = None) -> None:
        """End `seq`; with `last_index`, tokens after that index (sampled ahead) are dropped."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if last_index is not None:
            del seq.token_ids[last_index + 1 :]
        elif seq.token_ids and seq.token_ids[-1] == PENDING:
            seq.token_ids.pop()  # aborted with a token in flight
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_blocks(seq)
        else:
            self.waiting.remove(seq)
            if seq.block_table:
                self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
