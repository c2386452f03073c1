"""Results handed back to users, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np


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
    run reads as None (a prompt's first token, which nothing predicts).

    The engine's columns are numpy arrays, and a sequence's prompt logprobs are views of its steps' arrays
    (`extend_from`). A 16k-token step at 20 alternatives has 344k entries: as Python lists they took the engine's
    thread 25-35 ms per step, their texts 30 ms more, and pickling them to a formatting process 65 ms. The columns read as lists (`starts`, `token_ids`, `logprobs`, `ranks`), made once when first read;
    a pickled copy carries arrays. Texts are a list per entry (`decoded_tokens`) or a vocabulary's texts by token id
    (`use_vocabulary`); a pickled copy leaves the vocabulary behind (`wants_vocabulary`) and its reader attaches its
    own."""

    __slots__ = ("_starts", "_token_ids", "_logprobs", "_ranks", "_runs", "_texts", "_vocabulary", "_vocabulary_texts")

    def __init__(self, starts: list[int] | np.ndarray | None = None, token_ids: list[int] | np.ndarray | None = None,
                 logprobs: list[float] | np.ndarray | None = None, ranks: list[int] | np.ndarray | None = None,
                 decoded_tokens: list[str | None] | None = None) -> None:
        # each column a list, or a numpy array (read as a list once): starts [positions + 1], the others [entries],
        # each position's own token first
        self._starts: list[int] | np.ndarray = [0] if starts is None else starts
        self._token_ids: list[int] | np.ndarray = [] if token_ids is None else token_ids
        self._logprobs: list[float] | np.ndarray = [] if logprobs is None else logprobs
        self._ranks: list[int] | np.ndarray = [] if ranks is None else ranks
        # positions appended from numpy columns, not joined yet: runs of (each position's end, counted from the
        # run's first entry [positions], token_ids, logprobs, ranks [entries])
        self._runs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._texts = decoded_tokens  # [entries] or None
        self._vocabulary: Sequence[str] | None = None  # texts by token id, where the texts are a vocabulary's
        self._vocabulary_texts = False  # the texts are a vocabulary's (attached, or not yet in a pickled copy)

    @classmethod
    def from_entries(cls, entries: Iterable[dict[int, Logprob] | None]) -> FlatLogprobs:
        """The columns of a list of per-position dicts (None or {} for an empty position)."""
        starts, token_ids, logprobs, ranks, texts = [0], [], [], [], []
        for entry in entries:
            for t, v in (entry or {}).items():
                token_ids.append(t)
                logprobs.append(v.logprob)
                ranks.append(v.rank)
                texts.append(v.decoded_token)
            starts.append(len(token_ids))
        return cls(starts, token_ids, logprobs, ranks, texts)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ columns
    def _as_lists(self) -> None:
        """Join the runs and make every column a list (once)."""
        if not self._runs and type(self._starts) is list:
            return
        starts, token_ids, logprobs, ranks = (c if type(c) is list else c.tolist()  # type: ignore[union-attr]
                                              for c in (self._starts, self._token_ids, self._logprobs, self._ranks))
        for ends, ids, lps, rks in self._runs:
            starts.extend((ends + len(token_ids)).tolist())
            token_ids.extend(ids.tolist())
            logprobs.extend(lps.tolist())
            ranks.extend(rks.tolist())
        self._starts, self._token_ids, self._logprobs, self._ranks = starts, token_ids, logprobs, ranks
        self._runs = []

    def _columns(self) -> tuple[list[int] | np.ndarray, ...]:
        """(starts, token_ids, logprobs, ranks) with the runs joined: arrays where there are runs (a list column
        before them widens to int64 / float64, which keep its values), else the columns as they are."""
        if not self._runs:
            return self._starts, self._token_ids, self._logprobs, self._ranks
        ends: list[np.ndarray] = [np.asarray(self._starts, dtype=np.int64)]
        entries = len(self._token_ids)
        for run in self._runs:
            ends.append(run[0] + entries)
            entries += len(run[1])

        def joined(first: list | np.ndarray, rest: list[np.ndarray]) -> np.ndarray:
            return np.concatenate([np.asarray(first), *rest] if len(first) else rest)

        return (np.concatenate(ends), joined(self._token_ids, [r[1] for r in self._runs]),
                joined(self._logprobs, [r[2] for r in self._runs]), joined(self._ranks, [r[3] for r in self._runs]))

    @property
    def starts(self) -> list[int]:  # [positions + 1]
        self._as_lists()
        return self._starts  # type: ignore[return-value]

    @property
    def token_ids(self) -> list[int]:  # [entries]
        self._as_lists()
        return self._token_ids  # type: ignore[return-value]

    @property
    def logprobs(self) -> list[float]:  # [entries]
        self._as_lists()
        return self._logprobs  # type: ignore[return-value]

    @property
    def ranks(self) -> list[int]:  # [entries]
        self._as_lists()
        return self._ranks  # type: ignore[return-value]

    # ------------------------------------------------------------------ texts
    @property
    def decoded_tokens(self) -> list[str | None] | None:
        """Each entry's text, or None where none were given."""
        if self._texts is None and self._vocabulary is not None:
            vocabulary = self._vocabulary
            self._texts = [vocabulary[t] for t in self.token_ids]
        return self._texts

    @decoded_tokens.setter
    def decoded_tokens(self, texts: list[str | None] | None) -> None:
        self._texts, self._vocabulary, self._vocabulary_texts = texts, None, False

    def use_vocabulary(self, vocabulary: Sequence[str]) -> None:
        """Entry j's text is vocabulary[token_ids[j]] (made into a list when first read): `vocabulary` must hold
        every id of the columns."""
        self._texts, self._vocabulary, self._vocabulary_texts = None, vocabulary, True

    @property
    def wants_vocabulary(self) -> bool:
        """A pickled copy whose texts are a vocabulary's: its reader attaches one (`use_vocabulary`)."""
        return self._vocabulary_texts and self._vocabulary is None

    @property
    def vocabulary(self) -> Sequence[str] | None:
        """The vocabulary whose texts the entries have (by token id), None where texts are given per entry."""
        return self._vocabulary if self._vocabulary_texts else None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(starts [positions + 1], token_ids, logprobs, ranks [entries]) as numpy arrays (list columns converted:
        ints as int64, floats as float64)."""
        return tuple(np.asarray(c) for c in self._columns())  # type: ignore[return-value]

    def max_token_id(self) -> int:
        """The largest id of the columns (-1 where there are none)."""
        ids = self._columns()[1]
        return int(np.max(ids)) if len(ids) else -1

    def __reduce__(self) -> tuple:
        texts = None if self._vocabulary_texts else self._texts
        return (_unpickle_flat, (*self._columns(), texts, self._vocabulary_texts))

    # ------------------------------------------------------------------ the Sequence
    def __len__(self) -> int:
        return len(self._starts) - 1 + sum(len(run[0]) for run in self._runs)

    def _entry(self, i: int) -> dict[int, Logprob] | None:
        starts = self.starts
        lo, hi = starts[i], starts[i + 1]
        if lo == hi:
            return None
        ids, values, ranks, texts = self._token_ids, self._logprobs, self._ranks, self.decoded_tokens
        return {ids[j]: Logprob(values[j], ranks[j], None if texts is None else texts[j])  # type: ignore[index]
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

    # ------------------------------------------------------------------ appending (the engine)
    def append_empty(self) -> None:
        """A position without logprobs (reads as None)."""
        if self._runs or type(self._starts) is not list:
            self._runs.append((np.zeros(1, dtype=np.int64), _NO_IDS, _NO_VALUES, _NO_IDS))
        else:
            self._starts.append(self._starts[-1])

    def append_from(self, other: FlatLogprobs, i: int) -> None:
        """Append `other`'s position i (a step's row: one call per generated token)."""
        starts, ids, values, ranks = other.starts, other._token_ids, other._logprobs, other._ranks
        lo, hi = starts[i], starts[i + 1]
        self._as_lists()
        if hi - lo == 1:
            self._token_ids.append(ids[lo])  # type: ignore[union-attr]
            self._logprobs.append(values[lo])  # type: ignore[union-attr]
            self._ranks.append(ranks[lo])  # type: ignore[union-attr]
        else:
            self._token_ids.extend(ids[lo:hi])  # type: ignore[union-attr]
            self._logprobs.extend(values[lo:hi])  # type: ignore[union-attr]
            self._ranks.extend(ranks[lo:hi])  # type: ignore[union-attr]
        self._starts.append(self._starts[-1] + hi - lo)  # type: ignore[union-attr]

    def extend_from(self, other: FlatLogprobs, first: int, end: int) -> None:
        """Append `other`'s positions first..end-1 (from numpy columns: as views, joined when read)."""
        if self._texts is not None or self._vocabulary_texts or other._texts is not None or other._vocabulary_texts:
            raise ValueError("extend_from joins undecoded logprobs; decode them once they are complete")
        if type(other._starts) is not list and not other._runs:
            s = other._starts
            lo, hi = int(s[first]), int(s[end])  # type: ignore[call-overload]
            self._runs.append((s[first + 1 : end + 1] - lo, other._token_ids[lo:hi],  # type: ignore[operator]
                               other._logprobs[lo:hi], other._ranks[lo:hi]))
            return
        starts = other.starts
        lo, hi = starts[first], starts[end]
        self._as_lists()
        base = self._starts[-1] - lo
        self._starts.extend(s + base for s in starts[first + 1 : end + 1])  # type: ignore[union-attr]
        self._token_ids.extend(other._token_ids[lo:hi])  # type: ignore[union-attr]
        self._logprobs.extend(other._logprobs[lo:hi])  # type: ignore[union-attr]
        self._ranks.extend(other._ranks[lo:hi])  # type: ignore[union-attr]


_NO_IDS = np.zeros(0, dtype=np.int32)
_NO_VALUES = np.zeros(0, dtype=np.float32)


def _unpickle_flat(starts: list | np.ndarray, token_ids: list | np.ndarray, logprobs: list | np.ndarray,
                   ranks: list | np.ndarray, texts: list[str | None] | None, vocabulary_texts: bool) -> FlatLogprobs:
    flat = FlatLogprobs(starts, token_ids, logprobs, ranks, texts)
    flat._vocabulary_texts = vocabulary_texts
    return flat


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
