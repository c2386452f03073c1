"""outputs.FlatLogprobs reads as the list of {token_id: Logprob} dicts it stands for, and engine/sampler's
TokenLogprobs builds it with vLLM's layout: the given token first with its own rank, then the top ones without it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from nvcli.engine.sampler import TokenLogprobs, pack_columns
from nvcli.outputs import FlatLogprobs, Logprob


def _flat() -> FlatLogprobs:
    flat = FlatLogprobs()
    flat.append_empty()  # a prompt's first token
    more = FlatLogprobs([0, 2, 3], [5, 9, 7], [-0.5, -0.25, -1.0], [2, 1, 1])
    flat.extend_from(more, 0, 2)
    return flat


def test_positions_read_as_dicts_and_an_empty_one_as_none() -> None:
    flat = _flat()
    want = [None, {5: Logprob(-0.5, 2), 9: Logprob(-0.25, 1)}, {7: Logprob(-1.0, 1)}]
    assert len(flat) == 3 and list(flat) == want and flat == want
    assert flat[1] == want[1] and flat[-1] == want[2] and flat[1:] == want[1:]
    assert [*flat[::-1]] == want[::-1]
    with pytest.raises(IndexError):
        flat[3]
    assert flat != want[:2] and flat != [None, {5: Logprob(-0.5, 2)}, want[2]]
    assert bool(FlatLogprobs()) is False and bool(flat) is True


def test_decoded_tokens_reach_each_logprob() -> None:
    flat = _flat()
    flat.decoded_tokens = ["a", "b", "c"]
    assert flat[1] == {5: Logprob(-0.5, 2, "a"), 9: Logprob(-0.25, 1, "b")} and flat[2][7].decoded_token == "c"
    with pytest.raises(ValueError, match="decode"):
        flat.extend_from(FlatLogprobs([0, 1], [1], [0.0], [1]), 0, 1)


def test_extend_from_takes_a_middle_run() -> None:
    src = FlatLogprobs([0, 1, 3, 4, 6], [1, 2, 3, 4, 5, 6], [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [1, 2, 3, 4, 5, 6])
    flat = FlatLogprobs()
    flat.extend_from(src, 1, 3)
    assert flat == src[1:3] and flat.starts == [0, 2, 3]


def test_token_logprobs_flat_keeps_the_given_token_first_and_drops_it_from_the_top() -> None:
    """Row 0's token is also its top-1 (listed once, with its own rank); row 1 asks for one alternative of two;
    row 2 for none; row 3 is padding past len(ks)."""
    packed = torch.empty((4, 3 + 2 * 2), dtype=torch.int32)  # the torch path's packing (the kernel writes the same)
    pack_columns(
        packed,
        token_ids=torch.tensor([4, 8, 3, 0]),
        chosen=torch.tensor([-0.1, -2.0, -0.7, 0.0]),
        ranks=torch.tensor([1, 5, 2, 1], dtype=torch.int32),
        top_values=torch.tensor([[-0.1, -3.0], [-0.2, -0.9], [-0.3, -0.4], [0.0, 0.0]]),
        top_ids=torch.tensor([[4, 6], [1, 2], [5, 6], [0, 0]]),
    )
    found = TokenLogprobs(packed)
    flat = found.flat([2, 1, 0])
    f32 = lambda x: torch.tensor(x).item()  # noqa: E731 - the float32 values, as Python floats
    assert list(flat) == [
        {4: Logprob(f32(-0.1), 1), 6: Logprob(f32(-3.0), 2)},
        {8: Logprob(f32(-2.0), 5), 1: Logprob(f32(-0.2), 1)},
        {3: Logprob(f32(-0.7), 2)},
    ]
    assert all(isinstance(x, int) for x in flat.token_ids + flat.ranks)
    assert all(type(x) is float for x in flat.logprobs)


def test_append_from_takes_one_position_of_a_step() -> None:
    """The engine appends each generated token's logprobs from its step's rows, one position at a time."""
    step = FlatLogprobs([0, 1, 4], [7, 8, 9, 10], [-0.5, -1.0, -0.25, -2.0], [1, 3, 1, 4])
    seq = FlatLogprobs()
    seq.append_from(step, 1)
    seq.append_from(step, 0)
    assert seq == [step[1], step[0]] and seq.starts == [0, 3, 4]
    assert seq[0] == {8: Logprob(-1.0, 3), 9: Logprob(-0.25, 1), 10: Logprob(-2.0, 4)}


def test_from_entries_round_trips() -> None:
    entries = [None, {3: Logprob(-0.5, 2, "a"), 4: Logprob(-0.25, 1, "b")}, {5: Logprob(-1.0, 1, None)}]
    flat = FlatLogprobs.from_entries(entries)
    assert flat == entries and flat.starts == [0, 0, 2, 3] and flat.decoded_tokens == ["a", "b", None]


def _step(n: int, k: int, seed: int) -> FlatLogprobs:
    """A step's rows as TokenLogprobs.flat gives them: numpy columns, k alternatives per row."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.empty((n, 3 + 2 * k), dtype=torch.int32)
    pack_columns(packed, token_ids=torch.randint(0, 50, (n,), generator=g), chosen=-torch.rand(n, generator=g),
                 ranks=torch.randint(1, 9, (n,), generator=g, dtype=torch.int32),
                 top_values=-torch.rand(n, k, generator=g).sort(dim=1).values,
                 top_ids=torch.randint(0, 50, (n, k), generator=g))
    return TokenLogprobs(packed).flat(np.full(n, k))


def test_a_sequence_joins_runs_of_numpy_steps_as_the_lists_would() -> None:
    """The engine's prompt logprobs: an empty first position, then runs of its steps' rows, kept as views of the
    steps' arrays until read; they read (and compare, and pickle) as the same dicts built from lists."""
    a, b = _step(5, 3, 0), _step(4, 2, 1)
    seq = FlatLogprobs()
    seq.append_empty()
    seq.extend_from(a, 1, 4)
    seq.append_empty()
    seq.extend_from(b, 0, 2)
    want = [None, *list(a)[1:4], None, *list(b)[0:2]]
    assert len(seq) == len(want) == 7  # counted before anything joined the runs
    copy = pickle.loads(pickle.dumps(seq))
    assert seq == want and copy == want
    assert all(type(x) is float for x in copy.logprobs) and all(type(x) is int for x in copy.token_ids + copy.ranks)
    assert seq.starts == FlatLogprobs.from_entries(want).starts and copy.starts == seq.starts
    assert seq.max_token_id() == max(t for e in want if e for t in e)
    lists = FlatLogprobs.from_entries([{1: Logprob(-0.5, 1)}])  # list columns, then a numpy run after them
    lists.decoded_tokens = None
    lists.extend_from(a, 0, 1)
    assert pickle.loads(pickle.dumps(lists)) == [{1: Logprob(-0.5, 1)}, a[0]] == lists


def test_texts_from_a_vocabulary_stay_behind_when_pickled() -> None:
    """A finished sequence's texts come from the engine's vocabulary by id. A pickled copy (for a formatting process)
    carries no texts and says it wants a vocabulary; with one attached it reads as the original."""
    vocab = [f"w{i}" for i in range(50)]
    seq = FlatLogprobs()
    seq.append_empty()
    seq.extend_from(_step(3, 2, 2), 0, 3)
    seq.use_vocabulary(vocab)
    assert all(lp.decoded_token == vocab[t] for e in seq[1:] for t, lp in e.items())  # type: ignore[union-attr]
    assert not seq.wants_vocabulary
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.wants_vocabulary and copy.decoded_tokens is None
    copy.use_vocabulary(vocab)
    assert copy == seq and not copy.wants_vocabulary
    with pytest.raises(ValueError, match="decode"):
        seq.extend_from(_step(1, 1, 3), 0, 1)
    seq.decoded_tokens = ["x"] * len(seq.token_ids)  # explicit texts travel with a pickled copy
    assert pickle.loads(pickle.dumps(seq)).decoded_tokens == ["x"] * len(seq.token_ids)
