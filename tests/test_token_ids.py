import enum

import pytest

from nvcli.token_ids import valid_token_ids


class Tok(enum.IntEnum):
    A = 3


@pytest.mark.parametrize("ids, vocab, ok", [
    ([], 10, True),
    ([0, 9, 5], 10, True),
    ([0, 10], 10, False),  # the vocabulary's end is out
    ([3, -1], 10, False),
    ([3, -1], None, False),
    ([10**12], None, True),  # no vocabulary: only non-negative
    ([1, True], 10, False),  # JSON true is no token id
    ([False], None, False),
    ([1, 2.0], 10, False),
    ([1, "2"], 10, False),
    ([1, None], 10, False),
    ([Tok.A, 4], 10, True),  # int subclasses are ints
    ([Tok.A, True], 10, False),
])
def test_valid_token_ids(ids, vocab, ok):
    assert valid_token_ids(ids, vocab) is ok
