"""engine/spec_backoff.py: a sequence whose drafts are all rejected pauses drafting for 2, 4, 8, ... tokens (at most
MAX_PAUSE); one kept draft resets the pause; the outcome is read from the tokens the sequence kept. In the engine:
test_draft_model.py's test of a draft that never holds."""

from __future__ import annotations

from nvcli.engine.spec_backoff import MAX_PAUSE, Backoff


class _Seq:
    """What Backoff reads of a sequence: its token ids."""

    def __init__(self, n: int) -> None:
        self.token_ids = list(range(n))


def _verify(backoff: Backoff, seq: _Seq, drafts: list[int], kept: int) -> None:
    """A verify step of `drafts` that keeps the first `kept` of them, then appends one token of its own."""
    at = len(seq.token_ids)
    assert not backoff.paused(seq)
    backoff.proposed(seq, at, drafts)
    seq.token_ids += drafts[:kept] + [10_000 + at]  # the target's own token after the kept drafts: no draft equals it


def _paused_for(backoff: Backoff, seq: _Seq) -> int:
    """Plain steps (one token each) until the sequence may draft again."""
    steps = 0
    while backoff.paused(seq):
        seq.token_ids.append(20_000 + steps)
        steps += 1
    return steps


def test_rejections_double_the_pause_up_to_the_cap() -> None:
    backoff, seq = Backoff(), _Seq(10)
    pauses = []
    for _ in range(9):
        _verify(backoff, seq, [1, 2, 3, 4], kept=0)
        pauses.append(_paused_for(backoff, seq))
    assert pauses == [2, 4, 8, 16, 32, 64, 64, 64, 64]
    assert MAX_PAUSE == 64


def test_a_kept_draft_resets_the_pause() -> None:
    backoff, seq = Backoff(), _Seq(10)
    for _ in range(3):
        _verify(backoff, seq, [1, 2, 3, 4], kept=0)
        _paused_for(backoff, seq)
    _verify(backoff, seq, [5, 6, 7, 8], kept=1)
    assert not backoff.paused(seq)  # drafting again at once
    _verify(backoff, seq, [1, 2], kept=0)
    assert _paused_for(backoff, seq) == 2  # the first miss after a hit: the shortest pause


def test_every_draft_kept_and_no_outcome_before_the_verify_is_collected() -> None:
    backoff, seq = Backoff(), _Seq(5)
    backoff.proposed(seq, 5, [7, 8])
    assert not backoff.paused(seq)  # no token at index 5 yet: nothing to judge
    seq.token_ids += [7, 8, 9]
    assert not backoff.paused(seq)
    other = _Seq(5)
    assert not backoff.paused(other)  # sequences are judged on their own


def test_a_proposal_never_verified_is_judged_by_the_tokens_made_there() -> None:
    """Drafts cut by the scheduler: the plain tokens made at their index decide (they equal the drafts exactly where
    the drafts would have been kept)."""
    backoff, seq = Backoff(), _Seq(5)
    backoff.proposed(seq, 5, [7, 8])
    seq.token_ids.append(3)
    assert backoff.paused(seq)

