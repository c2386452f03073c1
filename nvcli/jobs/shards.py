"""Static shards (`nv generate --num-shards K --shard-index I`): K jobs, each serving a fixed part of one input, for
schedulers without Ray (a Slurm array of K tasks); `nv merge` (merge.py) puts their outputs back in input order.

A shard owns the input lines whose 0-based physical line number p has p mod K == I. Blank lines count: the line
number is the file's, whatever the lines hold, so every shard agrees on who owns a line without reading the others,
an error line's "line" and a line-number id mean what they mean in an unsharded job, and an edit that blanks a line
moves no other line to another shard. A blank line is then skipped by its owner, as an unsharded job skips it.

Each shard is an ordinary job over its lines: its own ids, order, `--resume`, error lines and exit code. One thing
differs: a shard sees only its own lines, so two lines that share an id in different shards are both served (an
unsharded job answers the second with a duplicate_id error line); `nv merge` refuses such a pair.
"""

from __future__ import annotations

from dataclasses import dataclass


class ShardError(ValueError):
    """A bad --num-shards / --shard-index setting; the message names the flag."""


@dataclass(frozen=True)
class Shard:
    count: int  # K, --num-shards
    index: int  # I, --shard-index: 0 <= index < count

    def __post_init__(self) -> None:
        # bool is an int: --num-shards true is a mistake, not 1
        if type(self.count) is not int or self.count < 1:
            raise ShardError(f"--num-shards: must be an integer of at least 1 (got {self.count!r})")
        if type(self.index) is not int or not 0 <= self.index < self.count:
            raise ShardError(f"--shard-index: must be from 0 to --num-shards - 1 = {self.count - 1} "
                             f"(got {self.index!r})")

    def owns(self, line_no: int) -> bool:
        """Whether the input line at 0-based physical line number `line_no` is this shard's."""
        return line_no % self.count == self.index

    @classmethod
    def from_flags(cls, num_shards: int | None, shard_index: int | None) -> Shard | None:
        """The shard the two flags name, None for neither (the whole input); both or neither must be given."""
        if num_shards is None and shard_index is None:
            return None
        if shard_index is None:
            raise ShardError("--num-shards: goes with --shard-index I (this job's shard, 0 to K - 1)")
        if num_shards is None:
            raise ShardError("--shard-index: goes with --num-shards K (how many shards the input is split into)")
        return cls(num_shards, shard_index)
