"""How a step's one-token rows read the KV cache: the decode kernel's program order and, where the rows begin with
the same cached pages, the shared-prefix kernel's groups. Pure numpy: the host plans, the kernels read the plan.

A decode step's rows go to the decode kernel's programs longest first (the longest sequences start first and the
short ones fill the tail). Steps whose rows all begin with the same cached pages (one instruction in front of every
line of a job) read those pages once per group of rows (kernels/shared_prefix_attention.py). It pays where the
shared pages are at least half of the step's KV; below SHARED_PREFIX_MIN_ROWS rows the ordinary kernel's splits fill
the GPU better."""

from __future__ import annotations

import numpy as np

# must stay above sampler_graphs.MAX_ROWS, whose decode graphs end with the LM head and have no shared-prefix variant
SHARED_PREFIX_MIN_ROWS = 32
SHARED_PREFIX_MIN_TOKENS = 256


def longest_first(lens: np.ndarray) -> np.ndarray:
    """The decode kernel's program order of rows of lengths `lens`: longest first, ties in row order."""
    return np.argsort(-lens, kind="stable")


def num_groups(rows: int, seqs_per_group: int) -> int:
    """Groups of rows the shared-prefix kernel forms from `rows` one-token rows."""
    return -(-rows // seqs_per_group)


def shared_prefix_plan(tables: np.ndarray, lens: np.ndarray, block_size: int, seqs: int
                       ) -> tuple[np.ndarray, np.ndarray] | None:
    """How the shared-prefix kernel should read a decode step's rows, or None where sharing saves too little.

    tables [>= rows, width], lens [rows] (each > 0): the step's. The rows go to the kernel in groups of `seqs`
    (kernels/shared_prefix_attention.seqs_per_group), and each group reads the pages all its tables begin with once.
    Returns (order [rows]: rows that begin with the same pages adjacent; shared [groups]: each group's shared
    tokens, whole pages that leave every row of the group its last token, 0 below SHARED_PREFIX_MIN_TOKENS). None
    below SHARED_PREFIX_MIN_ROWS rows, or where the shared pages hold less than half of the step's KV.

    Prefix caching hashes a block with everything before it, so rows that hold the same block at some page hold the
    same blocks before it. Sorting by the blocks at pages 0, 1, 3, 7, 15, ... (then longest first) therefore brings
    together the rows of each instruction, even where instructions begin alike (a chat template's header) and part
    later, at the cost of a few sort keys instead of every page."""
    rows = len(lens)
    if rows < SHARED_PREFIX_MIN_ROWS:
        return None
    depth = min(int((lens.max() - 1) // block_size), tables.shape[1])
    probes = [p for p in (0, 1, 3, 7, 15, 31, 63, 127, 255) if p < depth] or [0]
    order = np.lexsort((-lens, *(tables[:rows, p] for p in reversed(probes))))
    groups = num_groups(rows, seqs)
    idx = np.concatenate([order, np.full(groups * seqs - rows, order[-1])])  # the last group padded with its last row
    limit = (lens[idx].reshape(groups, seqs).min(axis=1) - 1) // block_size  # [groups] pages whole in every row
    width = min(int(limit.max()), tables.shape[1])
    if width * block_size < SHARED_PREFIX_MIN_TOKENS:
        return None
    t = tables[idx, :width].reshape(groups, seqs, width)
    same = (t == t[:, :1, :]).all(axis=1) & (np.arange(width) < limit[:, None])  # [groups, width]
    pages = np.where(same.all(axis=1), width, same.argmin(axis=1))  # leading pages every row of the group shares
    shared = (pages * block_size).astype(np.int32)
    shared[shared < SHARED_PREFIX_MIN_TOKENS] = 0
    real_rows = np.minimum(seqs, rows - np.arange(groups) * seqs)
    if 2 * int((shared.astype(np.int64) * real_rows).sum()) < int(lens.sum()):
        return None
    return order.astype(np.int32), shared
