"""One request's token state as the scheduler and block manager see it (no torch)."""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING

import numpy as np

from nvcli.outputs import FlatLogprobs
from nvcli.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nvcli.engine.structured_output import GrammarState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class BlockTable(list):
    """A sequence's block ids, in order. Only ever appended to while the sequence holds its blocks (freeing them
    replaces the table with a new one), so an int32 copy stays in step by copying just the ids appended since it was
    last read: a step's input building copies arrays, not hundreds of Python ints per row each step (a 256-row step
    of 1,088-token sequences: 353 -> 95 us on the CPU machine)."""

    __slots__ = ("_array", "_synced")

    def __init__(self, ids: list[int] | None = None) -> None:
        super().__init__(ids or ())
        self._array = np.empty(max(16, len(self)), dtype=np.int32)
        self._synced = 0

    def array(self) -> np.ndarray:
        """The ids as int32 [len(self)] (a view: valid until the next append)."""
        n = len(self)
        if n > self._synced:
            if n > len(self._array):
                grown = np.empty(max(n, 2 * len(self._array)), dtype=np.int32)
                grown[: self._synced] = self._array[: self._synced]
                self._array = grown
            self._array[self._synced : n] = self[self._synced : n]
            self._synced = n
        return self._array[:n]

    def __reduce__(self) -> tuple:
        return BlockTable, (list(self),)


def _resyncing(name: str):  # noqa: ANN202
    """List methods that change ids already copied: the copy starts over (the engine only appends)."""
    method = getattr(list, name)

    def changed(self: BlockTable, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        self._synced = 0
        return method(self, *args, **kwargs)

    changed.__name__ = name
    return changed


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "insert", "pop", "remove", "clear", "sort",
              "reverse"):
    setattr(BlockTable, _name, _resyncing(_name))


class Sequence:
    """Prompt plus generated tokens, how many of them have KV in the cache, and where.

    `num_computed_tokens` counts tokens whose K/V are stored in `block_table`'s blocks; a step
    schedules `num_tokens - num_computed_tokens` of them (or a chunk of that, for chunked
    prefill). A decode is the case where exactly one token, the last sampled one, is left.
    """

    _ids = itertools.count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        request_id: str | None = None,
        priority: int = 0,
    ) -> None:
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = next(Sequence._ids)  # also its arrival: ids only grow, so ties of priority go by arrival
        self.priority = priority  # --scheduling-policy priority: lower is served first (vLLM's)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.completion_index = 0  # which of its request's n completions this is
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = BlockTable()
        # Chained prefix-cache hashes of this sequence's full, computed blocks.
        self.block_hashes: list[int] = []
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first schedule)
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # per generated token, where asked for: flat columns, no objects per token (outputs.FlatLogprobs)
        self.logprobs = FlatLogprobs() if sampling_params.logprobs is not None else None
        # prompt_logprobs: positions 0..wanted-1 each predict the prompt token after them. `scheduled` counts the
        # positions a step has been given already (results come back in step order), so a recomputed prompt
        # (preemption) or a later chunk does not ask for them twice.
        self.num_prompt_logprobs_wanted = 0
        self.num_prompt_logprobs_scheduled = 0
        self.prompt_logprobs: FlatLogprobs | None = None  # set where asked for: by the completion that computes them
        # token ids the sampler must not draw while the output is shorter than min_tokens (EOS and stop ids)
        self.min_tokens_banned: tuple[int, ...] = ()
        self.grammar: GrammarState | None = None  # structured outputs: the matcher of this completion's tokens
        self.constraint_complete = False  # finished because its grammar allows nothing more (the last token is text)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Some prompt position still needs its logits computed (prompt_logprobs): the prompt cannot come from the
        prefix cache."""
        return self.num_prompt_logprobs_scheduled < self.num_prompt_logprobs_wanted

    @property
    def stop_token_ended(self) -> bool:
        """Finished by an EOS or stop token id (left out of the text); a stop string's stop_reason is the string."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str) and not self.constraint_complete

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
