"""Reasoning parsers (vLLM's `--reasoning-parser`): where a thinking model's reasoning ends and its answer begins.

Qwen3 and DeepSeek-R1 write their reasoning between `<think>` and `</think>` (both single tokens), then the answer.
With a parser set, a chat line's output is split in two (jobs/formatting.py): `reasoning` and the content, from which
tool calls are read. The engine uses the same markers to hold a structured-output constraint back until the reasoning
has ended (engine/structured_output.py), as vLLM does: a schema constrains the answer, not the thinking.

The two parsers differ where no `</think>` was generated:
- `deepseek_r1`: the whole output is reasoning (the model was cut off while thinking);
- `qwen3`: the same, unless the line turned thinking off (`chat_template_kwargs: {"enable_thinking": false}`): then
  the whole output is content. Qwen3's template then writes an empty `<think>\\n\\n</think>` into the prompt itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None
    content: str | None


def split_reasoning(parser: str, text: str, thinking_enabled: bool = True) -> ReasoningSplit:
    """The reasoning and the content of one completion's text, as vLLM's parser of that name reads them (a `<think>`
    the model wrote itself is dropped; empty parts are None)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}: choose one of {', '.join(REASONING_PARSERS)}")
    before, start, after = text.partition(THINK_START)
    text = after if start else before
    if THINK_END in text:
        reasoning, _, content = text.partition(THINK_END)
        return ReasoningSplit(reasoning, content or None)
    if parser == "qwen3" and not thinking_enabled:
        return ReasoningSplit(None, text)
    return ReasoningSplit(text or None, None)


def reasoning_ended(token_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    """Whether these tokens leave the model past its reasoning: the last marker among them is `</think>` (vLLM's
    `is_reasoning_end`). A prompt ending in Qwen3's `<think>\\n\\n</think>\\n\\n` (thinking off) has ended it."""
    for token in reversed(token_ids):
        if token == end_id:
            return True
        if token == start_id:
            return False
    return False
