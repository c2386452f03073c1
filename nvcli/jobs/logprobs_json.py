"""A scoring line's logprob lists, serialized from the engine's columns in one piece.

A native line with `prompt_logprobs: 20` over a 1,000-token prompt lists about 21,000 entries. Building a dict per
entry and handing them to orjson cost a formatting process about 20-30 ms per line, which bounded such a job at 4
processes. Here a line's entries are put together as bytes with numpy: the bytes of each entry's
token (`{"token_id":7,"token":"a","logprob":`, made once per token id of the vocabulary), of its logprob (orjson's
text for the float, from one `orjson.dumps` of the column) and the punctuation between them, placed by index
arithmetic into one array of pieces and joined. The caller puts the result into the line as an `orjson.Fragment`;
the line's bytes equal those of the dicts (tests/jobs/test_logprobs_json.py).

Only the engine's own columns take this path: texts are a vocabulary's, every position holds its own token first,
no logprob is NaN. Anything else returns None, and the caller formats dicts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nvcli.jobs.jsonio import FRAGMENTS, orjson
from nvcli.outputs import FlatLogprobs

_TOPS_OPEN = b',"top_logprobs":['
_CLOSE = b"},"  # an entry's object, and the comma after it
_CLOSE_LAST_TOP = b"}]},"  # a position's last top entry, its list and its object
_RANK = b',"rank":'


class _TokenPieces:
    """Per token id of a vocabulary, the bytes that hold its id and text in each shape, made when first needed."""

    def __init__(self, vocabulary: Sequence[str]) -> None:
        self.vocabulary = vocabulary
        self.tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # shape -> ([vocab] bytes, [vocab] made)

    def of(self, shape: str, ids: np.ndarray) -> np.ndarray:
        """[n] bytes of token ids [n]: `native` `{"token_id":ID,"token":TEXT,"logprob":`, `vllm_key` `"ID":{"logprob":`,
        `vllm_end` `,"decoded_token":TEXT}`."""
        if shape not in self.tables:
            self.tables[shape] = (np.empty(len(self.vocabulary), dtype=object), np.zeros(len(self.vocabulary), bool))
        table, made = self.tables[shape]
        missing = np.unique(ids[~made[ids]])
        if len(missing):
            vocab, dumps = self.vocabulary, orjson.dumps
            if shape == "native":
                table[missing] = [b'{"token_id":%d,"token":%b,"logprob":' % (i, dumps(vocab[i])) for i in missing.tolist()]
            elif shape == "vllm_key":
                table[missing] = [b'"%d":{"logprob":' % i for i in missing.tolist()]
            else:
                table[missing] = [b',"decoded_token":%b}' % dumps(vocab[i]) for i in missing.tolist()]
            made[missing] = True
        return table[ids]


_pieces: dict[int, _TokenPieces] = {}  # by id() of the vocabulary, which each value holds on to


def _pieces_for(vocabulary: Sequence[str]) -> _TokenPieces:
    p = _pieces.get(id(vocabulary))
    if p is None or p.vocabulary is not vocabulary:
        if len(_pieces) > 4:  # a process sees one vocabulary, a test a few
            _pieces.clear()
        p = _pieces[id(vocabulary)] = _TokenPieces(vocabulary)
    return p


def _number_texts(values: np.ndarray) -> np.ndarray:
    """[n] bytes: each number as orjson writes the Python float or int it reads as (non-finite floats as null)."""
    wide = values.astype(np.float64 if values.dtype.kind == "f" else np.int64)
    text = orjson.dumps(wide, option=orjson.OPT_SERIALIZE_NUMPY)
    out = np.empty(len(values), dtype=object)
    out[:] = text[1:-1].split(b",") if len(values) else []
    return out


def _columns(flat: FlatLogprobs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The engine's columns as arrays, or None where `flat` is not theirs: texts given per entry, logprobs that are
    not all numbers, ids its vocabulary lacks."""
    if not FRAGMENTS or flat.vocabulary is None:
        return None
    starts, ids, values, ranks = flat.arrays()
    if values.dtype.kind != "f" or ids.dtype.kind not in "iuf" or np.isnan(values).any():
        return None
    ids = ids.astype(np.int64, copy=False)  # an empty list column reads as float64
    if len(ids) and not 0 <= ids.min() <= ids.max() < len(flat.vocabulary):
        return None
    return starts.astype(np.int64, copy=False), ids, values, ranks


def native_positions(flat: FlatLogprobs, token_ids: Sequence[int], k: int, first: int) -> bytes | None:
    """The native shape's list for positions first..first+len(token_ids)-1 of `flat` (without its brackets): per
    position `{"token_id", "token", "logprob"}` of its token, with `"top_logprobs"` (its k most likely entries, the
    most likely first, ties in the position's order) for k > 0. None where the columns are not the engine's."""
    columns = _columns(flat)
    if columns is None:
        return None
    starts, ids, values, _ = columns
    n = len(token_ids)
    if n == 0:
        return b""
    if len(starts) < first + n + 1:
        return None  # fewer positions than tokens: the dicts' formatter reports it
    los, his = starts[first : first + n], starts[first + 1 : first + n + 1]
    counts = his - los  # [n]
    if (counts < 1).any() or not np.array_equal(ids[los], np.asarray(token_ids)):
        return None  # a position without its own token first
    lo, hi = int(los[0]), int(his[-1])
    own = los - lo  # [n] indices into the entries lo..hi-1
    logprob_texts = _number_texts(values[lo:hi])  # [entries]
    prefixes = _pieces_for(flat.vocabulary).of("native", ids[lo:hi])  # type: ignore[arg-type]
    if k <= 0:
        pieces = np.empty(3 * n, dtype=object)
        pieces[0::3], pieces[1::3], pieces[2::3] = prefixes[own], logprob_texts[own], _CLOSE
        return b"".join(pieces.tolist())[:-1]
    place = _places(values[lo:hi], own, counts)  # [entries]: 0 for a position's most likely entry
    keep = place < k
    kept, kept_place = np.flatnonzero(keep), place[keep]  # [tops]
    kept_position = np.repeat(np.arange(n), counts)[keep]
    n_tops = np.minimum(counts, k)  # [n]
    first_piece = 3 * np.arange(n) + 3 * (np.cumsum(n_tops) - n_tops)  # [n]
    pieces = np.empty(3 * (n + len(kept)), dtype=object)
    pieces[first_piece] = prefixes[own]
    pieces[first_piece + 1] = logprob_texts[own]
    pieces[first_piece + 2] = _TOPS_OPEN
    at = first_piece[kept_position] + 3 + 3 * kept_place  # [tops]
    pieces[at] = prefixes[kept]
    pieces[at + 1] = logprob_texts[kept]
    pieces[at + 2] = _CLOSE
    pieces[at[kept_place == n_tops[kept_position] - 1] + 2] = _CLOSE_LAST_TOP
    return b"".join(pieces.tolist())[:-1]


def _places(values: np.ndarray, own: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[entries]: each entry's place in its position when the position's entries are ordered most likely first, ties
    in their order (a stable sort, as Python's sorted(reverse=True)); `own` [n] is where each position starts."""
    position = np.repeat(np.arange(len(own)), counts)  # [entries]
    index = np.arange(len(values)) - own[position]  # within the position, 0 for its own token
    alternative = index > 0
    in_order = index[1:] >= 2  # entry j + 1 follows an alternative of its position
    if (values[:-1][in_order] >= values[1:][in_order]).all():
        # the engine's order: the alternatives most likely first, so only the own token's place is to be found:
        # after every alternative above it, before those it ties with
        above = alternative & (values > values[own][position])
        place = index - above  # an alternative moves one place down unless it is above the own token
        place[own] = np.bincount(position, weights=above, minlength=len(own)).astype(np.int64)
        return place
    order = np.lexsort((-values, position))
    place = np.empty(len(values), dtype=np.int64)
    place[order] = np.arange(len(values)) - own[position[order]]
    return place


def vllm_positions(flat: FlatLogprobs) -> bytes | None:
    """vLLM's prompt_logprobs list (without its brackets): per position null (no entries) or {"ID": {"logprob",
    "rank", "decoded_token"}} over its entries in their order. None where the columns are not the engine's, or
    where a position holds a token twice (a dict keeps one)."""
    columns = _columns(flat)
    if columns is None:
        return None
    starts, ids, values, ranks = columns
    n, entries = len(starts) - 1, len(ids)
    if ranks.dtype.kind not in "iu":
        return None  # ranks given as None
    if n == 0:
        return b""
    counts = np.diff(starts)  # [n]
    position = np.repeat(np.arange(n), counts)  # [entries]
    keys = np.sort(position * (int(ids.max(initial=0)) + 1) + ids)
    if (keys[1:] == keys[:-1]).any():
        return None
    pieces_of = _pieces_for(flat.vocabulary)  # type: ignore[arg-type]
    # per position an opening piece ("{" or "null,"), then per entry: key, logprob, rank, rank's text, end, comma
    first_piece = np.arange(n) + 6 * starts[:-1]  # [n]
    pieces = np.empty(n + 6 * entries, dtype=object)
    pieces[first_piece] = b"{"
    pieces[first_piece[counts == 0]] = b"null,"
    at = first_piece[position] + 1 + 6 * (np.arange(entries) - starts[:-1][position])  # [entries]
    pieces[at] = pieces_of.of("vllm_key", ids)
    pieces[at + 1] = _number_texts(values)
    pieces[at + 2] = _RANK
    pieces[at + 3] = _number_texts(ranks)
    pieces[at + 4] = pieces_of.of("vllm_end", ids)
    pieces[at + 5] = b","
    pieces[at[starts[1:][counts > 0] - 1] + 5] = b"},"  # a position's last entry closes its object
    return b"".join(pieces.tolist())[:-1]
