"""Structured outputs: a grammar matcher per constrained sequence, and each step's mask of allowed tokens.

llguidance (the library vLLM's `guidance` backend uses) turns a request's constraint (JSON schema, regex, choice list,
Lark or GBNF grammar) into a grammar over the tokenizer's tokens. Every completion of a constrained request holds its own
matcher, fed each token the engine accepts. A step that samples constrained rows asks their matchers which tokens may
come next: one bit per token, 32 tokens per int32 word, filled on llguidance's thread pool. The model runner applies
the mask to those rows' logits (-inf where the bit is 0) before sampling, so every draw keeps the output a prefix of
something the constraint accepts.

A verify step of speculative decoding (engine/spec_decode.py) samples a constrained sequence at each drafted position
too: each position's mask is the matcher's after the drafts before it (`GrammarCompiler.step_mask`), and the matcher
takes only the tokens the step keeps.

With async scheduling the next step is launched before this one's tokens are read, and a mask needs the token before
it. So the engine launches the step's forward first, reads the previous step's tokens while the device runs it, then
fills the masks and launches the sampling (`LLMEngine.step`). The forward still overlaps the host.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nvcli.engine.verify_rows import first_extra_rows
from nvcli.sampling_params import StructuredOutputsParams


def mask_words(vocab_size: int) -> int:
    """The int32 words of a token bitmask over `vocab_size` tokens (one bit a token, 32 a word)."""
    return (vocab_size + 31) // 32


class ConstrainedRow(Protocol):
    """What the masks read of a step's sequence (engine/sequence.Sequence)."""

    grammar: GrammarState | None
    num_prompt_tokens: int
    token_ids: list[int]

    @property
    def is_finished(self) -> bool: ...

_CACHED_GRAMMARS = 256  # a job usually repeats one schema on every line: compile it once


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint's grammar text, checked, and the mask of its first token (the same for every matcher of it)."""

    text: str
    first_mask: torch.Tensor  # [ceil(vocab / 32)] int32


class GrammarState:
    """One sequence's matcher, how many of its output tokens it has seen, and how many of those the matcher took.

    `reasoning_end` (--reasoning-parser): the token that ends the model's reasoning, while it has not come. Until then
    the row samples unconstrained and its tokens pass the matcher by (vLLM's rule: a schema constrains the answer).
    """

    def __init__(self, matcher: Any, grammar: CompiledGrammar, reasoning_end: int | None = None) -> None:
        self.matcher = matcher
        self.grammar = grammar
        self.reasoning_end = reasoning_end
        self.consumed = 0
        self.fed = 0

    @property
    def is_done(self) -> bool:
        """Nothing may follow: the constraint is complete (or the matcher failed). The sequence ends here."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, the sequence's next ones, the constraint allows (a verify row's drafts: every draft
        after the first refused one would be rejected anyway). The matcher is left as it was. Tokens up to the
        reasoning end, while reasoning, are free."""
        if self.is_done:
            return 0
        free = 0
        if self.reasoning_end is not None:
            if self.reasoning_end not in tokens:
                return len(tokens)
            free = tokens.index(self.reasoning_end) + 1
        return free + self.matcher.validate_tokens(tokens[free:])

    def take(self, token: int) -> None:
        """The sequence's next token on the matcher's side: the reasoning end starts the constraint, a reasoning token
        passes it by, any other the matcher consumes (none once the constraint is done: nothing may follow)."""
        if self.reasoning_end is not None:
            if token == self.reasoning_end:
                self.reasoning_end = None  # the constraint starts with the next token
        elif not self.is_done:
            self.matcher.consume_token(token)
            self.fed += 1

    def cursor(self) -> GrammarState | None:
        """A copy of this state (every kept token consumed) that a draft model runs ahead over its own drafts
        (engine/draft_model.py: `take` each draft, `next_mask` before the next), so that each draft is the draft
        model's argmax among the tokens the constraint allows there, as the target samples under the same mask; this
        state's matcher is untouched. None once done."""
        return None if self.is_done else GrammarState(self.matcher.deep_copy(), self.grammar, self.reasoning_end)

    def next_mask(self, words: int) -> torch.Tensor | None:
        """The next token's allowed tokens, a [words] int32 bitmask (once the constraint is complete: EOS alone); None
        where it is free (reasoning) or where the matcher failed (a token it refused: no later draft is kept)."""
        if self.reasoning_end is not None or self.matcher.is_error():
            return None
        bits = torch.empty(words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
        return bits


class GrammarCompiler:
    """Builds matchers for one tokenizer. The tokenizer's llguidance form takes about a second to build, so it is
    made at the first constrained request, not at start-up."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        # the model's vocab (the logits' width) may exceed the tokenizer's: tokens past it are never allowed
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids) or None)
        self._executor = llguidance.LLExecutor()
        self._grammars: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self.vocab_size = vocab_size
        self.mask_words = mask_words(vocab_size)
        self.mask_s = 0.0  # host seconds spent filling masks (benchmarks report it per step)
        self.num_masked_steps = 0
        self.consume_s = 0.0  # host seconds spent feeding tokens to matchers

    def grammar(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint compiled and checked: ValueError with llguidance's message if it does not compile."""
        key = params.key
        compiled = self._grammars.get(key)
        if compiled is not None:
            self._grammars.move_to_end(key)
            return compiled
        try:
            text = grammar_text(params)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
        matcher = self._llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {_one_line(matcher.get_error())}")
        # A new matcher's first mask is the slowest to compute (nothing cached yet), and it falls in the step that
        # finishes the prompt, whose eager launch keeps the host busy: computed here once, copied for every request.
        first_mask = torch.empty(self.mask_words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(first_mask.data_ptr(), self.mask_words * 4)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {_one_line(matcher.get_error())}")
        compiled = self._grammars[key] = CompiledGrammar(text, first_mask)
        if len(self._grammars) > _CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return compiled

    def consume(self, state: GrammarState, token: int) -> None:
        """The state's matcher takes its sequence's next kept token (each kept token once, in order; the engine never
        feeds a token sampled past the one that ended its sequence). In this thread: 2-5 us a token, where
        llguidance's thread pool (`consume_token_par`) cost more than it saved at 8-256 rows on the CPU machine. A
        refused token leaves the matcher in its error state (`is_done`)."""
        t0 = time.perf_counter()
        state.consumed += 1
        state.take(token)
        self.consume_s += time.perf_counter() - t0

    def new_state(self, grammar: CompiledGrammar, reasoning_end: int | None = None) -> GrammarState:
        return GrammarState(self._llguidance.LLMatcher(self._tokenizer, grammar.text, log_level=0), grammar,
                            reasoning_end)

    def step_mask(self, seqs: Sequence[ConstrainedRow], sample_index: Sequence[int], num_drafts: Sequence[int] = ()
                  ) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [len(rows), mask_words] int32) for the logits rows of a step (its sequences, the index of
        the token each samples, -1 for none, and the drafts each verifies) that sample a constrained token now; None
        if there are none. Every token a row's matcher needs must have been consumed (the engine collects the
        previous step first). Rows that sample nothing (a prompt chunk), or whose sequence ended while this step was
        in flight, are left out: their token is dropped anyway.

        A verify row (k drafts d1..dk, engine/spec_decode.py) samples k + 1 positions: position m at its m-th extra
        row (the extra rows follow every sequence's own row, in batch order: engine/verify_rows.py), position k
        at its own row. Position m's mask is the matcher's after d1..dm: llguidance consumes the drafts tentatively
        and rolls them back (the matcher is left as it was). Positions after a draft the constraint refuses, or after
        an EOS draft, keep an all-ones mask: the refused draft is rejected, and a kept EOS ends the sequence, so
        nothing sampled there is kept."""
        entries: list[tuple[Any, int, list[int]]] = []  # (matcher, mask row of its first position, its drafts)
        firsts: list[tuple[int, torch.Tensor]] = []  # (mask row, the grammar's first mask)
        verify_rows: list[int] = []  # mask rows past an entry's first: unwritten past a refused draft or EOS
        rows: list[int] = []
        extra = first_extra_rows(len(seqs), num_drafts)
        for row, (seq, index) in enumerate(zip(seqs, sample_index)):
            k = extra[row + 1] - extra[row]
            logits_rows = [*range(extra[row], extra[row + 1]), row]  # position m's row
            state: GrammarState | None = seq.grammar
            if state is None or index < 0 or seq.is_finished or state.is_done:
                continue
            first = index - k  # the first position's token index
            assert state.consumed == first - seq.num_prompt_tokens, "a constrained row's previous token is unread"
            drafts = seq.token_ids[first:index]
            free = 0  # leading positions still reasoning: unconstrained
            if state.reasoning_end is not None:
                if state.reasoning_end not in drafts:
                    continue
                free = drafts.index(state.reasoning_end) + 1  # the positions after it sample the constraint's tokens
            if free == k and not state.fed:
                firsts.append((len(rows), state.grammar.first_mask))
            else:
                entries.append((state.matcher, len(rows), drafts[free:]))
                verify_rows.extend(range(len(rows) + 1, len(rows) + 1 + k - free))
            rows.extend(logits_rows[free:])
        if not rows:
            return None
        t0 = time.perf_counter()
        mask = torch.empty((len(rows), self.mask_words), dtype=torch.int32,
                           pin_memory=torch.cuda.is_available())  # the caching host allocator reuses it
        for i, first_mask in firsts:
            mask[i] = first_mask
        plain = [(matcher, i) for matcher, i, drafts in entries if not drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), self.mask_words * 4, len(rows))
        if verify_rows:
            mask[verify_rows] = -1
            self._executor.unsafe_compute_mask_ptr_with_draft_token([e for e in entries if e[2]], mask.data_ptr(),
                                                                    self.mask_words * 4, len(rows))
        self.mask_s += time.perf_counter() - t0
        self.num_masked_steps += 1
        return rows, mask


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as llguidance's grammar text; no tokenizer needed. ValueError, saying which, where it cannot be
    written at all: a JSON schema llguidance cannot read, a grammar that is neither Lark nor GBNF (the rest is checked
    when a matcher or `validate_grammar` compiles the text)."""
    from llguidance import LLMatcher, StructTag

    if params.json is not None or params.json_object:
        schema = {"type": "object"} if params.json_object else params.json
        if params.disable_additional_properties:
            schema = closed_objects(json.loads(schema) if isinstance(schema, str) else schema)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=json_whitespace(params))
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid: {e}") from None
    if params.structural_tag is not None:
        tags = []
        for trigger, begin, schema, end in params.structural_tags():
            if params.disable_additional_properties:
                schema = closed_objects(schema)
            # each segment's JSON takes the request's whitespace rule (a schema's own x-guidance options win; one
            # that is not an object is left for llguidance to refuse)
            own = schema.get("x-guidance", {})
            if isinstance(own, dict):
                schema = {**schema, "x-guidance": {**json_whitespace(params), **own}}
            tags.append(StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
        return StructTag.to_grammar(tags)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:  # JSON string literals are Lark's quoted strings, escapes included
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    assert params.grammar is not None
    from llguidance.gbnf_to_lark import any_to_lark

    try:  # GBNF (llama.cpp's, which vLLM's grammar backends take) becomes Lark; Lark stays as it is
        lark = any_to_lark(params.grammar)
    except Exception as e:  # noqa: BLE001 - the converter raises its own error types
        raise ValueError(f"the grammar is neither Lark nor GBNF: {e}") from e
    return LLMatcher.grammar_from_lark(lark)


def json_whitespace(params: StructuredOutputsParams) -> dict[str, Any]:
    """llguidance's JSON options for the whitespace between JSON's tokens: any (its default), none
    (disable_any_whitespace), or what whitespace_pattern matches."""
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.whitespace_pattern is not None:
        options["whitespace_pattern"] = params.whitespace_pattern
    return options


def closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which every object that lists `properties` or `patternProperties` and says nothing
    of `additionalProperties` takes no other keys (vLLM's `disable_additional_properties`)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_objects(value) for key, value in schema.items()}
    if "additionalProperties" not in out and ("properties" in out or "patternProperties" in out):
        out["additionalProperties"] = False
    return out


def constraint_problem(params: StructuredOutputsParams) -> str | None:
    """What llguidance finds wrong with a constraint (an unknown type, a $ref to nowhere, a bad regex) without a
    tokenizer, on one line; None if nothing."""
    from llguidance import LLMatcher

    try:
        text = grammar_text(params)
    except ValueError as e:
        return _one_line(str(e))
    return " ".join(LLMatcher.validate_grammar(text).split()) or None


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500] or "the constraint does not compile"
