"""Results handed back to users, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log probability under the model's own logits, its rank among the vocabulary
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(Sequence["dict[int, Logprob] | None"]):
    """A list of per-position {token_id: Logprob} dicts, stored as flat columns (vLLM's FlatLogprobs).

    A scoring job has a position for every prompt token: two million dicts of Logprob objects cost the engine's
    thread microseconds each to build, and Python's garbage collector then walks them all again and again. Here a
    position is the run `starts[i]:starts[i + 1]` of the columns, and its dict is built only when read. An empty
    run reads as None (a prompt's first token, which nothing predicts)."""

    __slots__ = ("starts", "token_ids", "logprobs", "ranks", "decoded_tokens")

    def __init__(self, starts: list[int] | None = None, token_ids: list[int] | None = None,
                 logprobs: list[float] | None = None, ranks: list[int] | None = None,
                 decoded_tokens: list[str | None] | None = None) -> None:
        self.starts = [0] if starts is None else starts  # [positions + 1]
        self.token_ids = [] if token_ids is None else token_ids  # [entries], each position's own token first
        self.logprobs = [] if logprobs is None else logprobs
        self.ranks = [] if ranks is None else ranks
        self.decoded_tokens = decoded_tokens  # [entries] or None: not decoded

    @classmethod
    def from_entries(cls, entries: Iterable[dict[int, Logprob] | None]) -> FlatLogprobs:
        """The columns of a list of per-position dicts (None or {} for an empty position)."""
        flat = cls(decoded_tokens=[])
        for entry in entries:
            for t, v in (entry or {}).items():
                flat.token_ids.append(t)
                flat.logprobs.append(v.logprob)
                flat.ranks.append(v.rank)  # type: ignore[arg-type]
                flat.decoded_tokens.append(v.decoded_token)  # type: ignore[union-attr]
            flat.starts.append(len(flat.token_ids))
        return flat

    def __len__(self) -> int:
        return len(self.starts) - 1

    def _entry(self, i: int) -> dict[int, Logprob] | None:
        lo, hi = self.starts[i], self.starts[i + 1]
        if lo == hi:
            return None
        texts = self.decoded_tokens
        return {self.token_ids[j]: Logprob(self.logprobs[j], self.ranks[j], None if texts is None else texts[j])
                for j in range(lo, hi)}

    @overload
    def __getitem__(self, i: int) -> dict[int, Logprob] | None: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[int, Logprob] | None]: ...
    def __getitem__(self, i: int | slice) -> dict[int, Logprob] | None | list[dict[int, Logprob] | None]:
        if isinstance(i, slice):
            return [self._entry(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("FlatLogprobs index out of range")
        return self._entry(i)

    def __iter__(self) -> Iterator[dict[int, Logprob] | None]:
        return (self._entry(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (FlatLogprobs, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"

    def append_empty(self) -> None:
        """A position without logprobs (reads as None)."""
        self.starts.append(self.starts[-1])

    def append_from(self, other: FlatLogprobs, i: int) -> None:
        """Append `other`'s position i (a step's row: one call per generated token)."""
        lo, hi = other.starts[i], other.starts[i + 1]
        if hi - lo == 1:
            self.token_ids.append(other.token_ids[lo])
            self.logprobs.append(other.logprobs[lo])
            self.ranks.append(other.ranks[lo])
        else:
            self.token_ids.extend(other.token_ids[lo:hi])
            self.logprobs.extend(other.logprobs[lo:hi])
            self.ranks.extend(other.ranks[lo:hi])
        self.starts.append(self.starts[-1] + hi - lo)

    def extend_from(self, other: FlatLogprobs, first: int, end: int) -> None:
        """Append `other`'s positions first..end-1."""
        lo, hi = other.starts[first], other.starts[end]
        base = self.starts[-1] - lo
        self.starts.extend(s + base for s in other.starts[first + 1 : end + 1])
        self.token_ids.extend(other.token_ids[lo:hi])
        self.logprobs.extend(other.logprobs[lo:hi])
        self.ranks.extend(other.ranks[lo:hi])
        if self.decoded_tokens is not None or other.decoded_tokens is not None:
            raise ValueError("extend_from joins undecoded logprobs; decode them once they are complete")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    # One dict per generated token: {token_id: Logprob}, the sampled token first, then the top alternatives (the
    # engine hands a FlatLogprobs: a Sequence of those dicts, built as they are read).
    logprobs: Sequence[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it), then {token_id:
    # Logprob} with the prompt's own token first and the top alternatives after it; None where not asked for.
    # The engine hands a FlatLogprobs (a Sequence of those dicts, built as they are read).
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
