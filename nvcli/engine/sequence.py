"""One request's token state as the scheduler and block manager see it (no torch)."""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING

from nvcli.outputs import FlatLogprobs
from nvcli.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nvcli.engine.structured_output import GrammarState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


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
    ) -> None:
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.completion_index = 0  # which of its request's n completions this is
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
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
