"""Incremental detokenization, used to spot stop strings as tokens arrive."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Appends text token by token without re-decoding the whole completion each time.

    Decodes a short window (the last emitted token(s) plus the new ones) and keeps only the new
    characters; a trailing U+FFFD means a multi-byte character is still incomplete, so it waits.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.tokens[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += new
            return new
        return ""


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters: (start index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
