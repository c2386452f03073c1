"""Continuous batching: which sequences run in the next step, and how many tokens each.

One policy for every step (no separate prefill and decode phases): running sequences come
first (a decode costs one token, an unfinished prompt gets the next chunk), then waiting ones
while the token budget, the sequence limit and the KV blocks allow. When a running sequence needs a
block and none is free, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed later (its generated tokens are kept).
Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nvcli.engine.block_manager import BlockManager
from nvcli.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed this step, per sequence

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 and s.num_computed_tokens == s.num_tokens - 1 for s, n in zip(self.seqs, self.num_new_tokens))

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
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prompt chunks that did not finish their prompt

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
    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens and not self.enable_chunked_prefill:
                break
            while not bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # seq preempted itself; everything after it is gone too
            bm.allocate(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1

        # Admit waiting sequences, unless this step already had to give blocks back.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            remaining = seq.num_tokens - len(cached) * bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                if seqs:
                    break
                raise RuntimeError("prompt exceeds max_num_batched_tokens and chunked prefill is off")
            if not bm.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            if cached:
                bm.take_cached_prefix(seq, cached)
            elif bm.enable_prefix_caching and seq.num_computed_tokens == 0:
                bm.prefix_query_tokens += seq.num_tokens
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n

        self.num_chunked_prefills += sum(1 for s, n in zip(seqs, counts) if n < s.num_uncomputed_tokens)
        return ScheduledBatch(seqs, counts)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the step
    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """Advance computed counts and append sampled tokens; returns the sequences that got a token.

        A prompt chunk that leaves tokens uncomputed produces no token (its sample is dropped).
        """
        produced: list[Sequence] = []
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, sampled):
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += n
            self.block_manager.register_computed_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.append_token(token)
            produced.append(seq)
        return produced

    def check_stop(self, seq: Sequence, eos_token_ids: set[int]) -> None:
        """Finish `seq` if its last token ends it (EOS, stop id, max_tokens or max_model_len)."""
        sp = seq.sampling_params
        token = seq.last_token
        n_out = seq.num_completion_tokens
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in eos_token_ids:
                return self.finish(seq, "stop", token)
            if token in sp.stop_token_ids:
                return self.finish(seq, "stop", token)
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return self.finish(seq, "length")
        if seq.num_tokens >= self.max_model_len:
            return self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status == SequenceStatus.FINISHED:
            return
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
