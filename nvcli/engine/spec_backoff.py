"""When a sequence stops drafting for a while: speculative decoding's backoff (engine/spec_decode.py).

A verify step costs more than a plain step (1.1-1.5x on the 8B shape, 1.4-2.9x with a draft model's forwards, and it
gives up async scheduling's overlap: benchmarks/RESULTS.md); it pays only through kept drafts. Where a sequence's
drafts keep being rejected (text the n-gram lookup mispredicts, a draft model that disagrees with the target), every
verify is a loss. So, per sequence: a verify that kept none of its drafts pauses the sequence's drafting for its
next 2, 4, 8, ... tokens (doubling with each consecutive such verify, at most MAX_PAUSE); a verify that kept one or
more resets it. A sequence whose drafts never hold verifies O(log n) times early and then once every MAX_PAUSE
tokens, instead of at every step; one whose drafts mostly hold is not slowed (a miss costs it at most 2 tokens of
drafting). A step in which every candidate sequence is paused is not a verify step at all: it keeps async overlap.

The outcome is read from the sequence itself, not reported by the scheduler: `proposed` records the index where the
drafts were placed and the drafts; the next `paused` call, once the sequence has a token at that index, counts the
leading drafts equal to the tokens it kept there. The drafts never change a kept token (the output is the target's:
spec_decode.py), so this count is exactly the accepted drafts of that verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

if TYPE_CHECKING:
    from nvcli.engine.sequence import Sequence

MAX_PAUSE = 64  # tokens: a sequence whose drafts never hold verifies once per this many (<= 1/64 of its steps)


def kept_drafts(tokens: list[int], at: int, drafts: tuple[int, ...]) -> int:
    """How many of `drafts`, placed at token index `at`, the sequence kept: its leading tokens from `at` on that equal
    them (a kept token is never changed afterwards)."""
    kept = 0
    while kept < len(drafts) and at + kept < len(tokens) and tokens[at + kept] == drafts[kept]:
        kept += 1
    return kept


@dataclass
class _Record:
    at: int = -1  # token index of the last verify's first draft; -1: no outcome pending
    drafts: tuple[int, ...] = ()
    misses: int = 0  # consecutive verifies that kept no draft
    resume_at: int = 0  # the sequence drafts again once it has this many tokens


class Backoff:
    def __init__(self, max_pause: int = MAX_PAUSE) -> None:
        self.max_pause = max_pause
        self._records: WeakKeyDictionary[Sequence, _Record] = WeakKeyDictionary()

    def proposed(self, seq: Sequence, at: int, drafts: list[int] | tuple[int, ...]) -> None:
        """`seq` verifies `drafts`, placed at token index `at`, in the step being scheduled."""
        record = self._records.get(seq)
        if record is None:
            record = self._records[seq] = _Record()
        record.at, record.drafts = at, tuple(drafts)

    def paused(self, seq: Sequence) -> bool:
        """Whether `seq` must not draft now (its last verify's outcome is read here first, once known)."""
        record = self._records.get(seq)
        if record is None:
            return False
        tokens = seq.token_ids
        if record.at >= 0 and len(tokens) > record.at:
            if kept_drafts(tokens, record.at, record.drafts):
                record.misses = 0
            else:
                record.misses += 1
                record.resume_at = len(tokens) + min(2**record.misses, self.max_pause)
            record.at = -1
        return len(tokens) < record.resume_at
