"""The sampling rows of a step that verifies drafts (speculative decoding): one layout that the scheduler, the
penalties, the grammar masks and the sampler's inputs all read.

Row i < num_seqs is sequence i's own row (its last position); every sequence's k_i extra rows (its drafted
positions, d1 .. dk in order) follow all the own rows, in batch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate


def first_extra_rows(num_seqs: int, num_drafts: Sequence[int] | None) -> list[int]:
    """num_seqs + 1 offsets for a step of `num_seqs` sequences with `num_drafts` drafts each (empty or None: none):
    sequence i's extra rows are out[i] .. out[i + 1] - 1 (out[i] = num_seqs + k_0 + ... + k_(i-1)), and out[-1] is
    the step's row count."""
    return list(accumulate(num_drafts or [0] * num_seqs, initial=num_seqs))
