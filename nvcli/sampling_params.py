"""Per-request sampling settings, validated at construction (vLLM-compatible names)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `StructuredOutputsParams`): exactly one of

    - `json`: a JSON schema (a dict, or its JSON text); the output is a JSON value that matches it;
    - `json_object`: True for any JSON object (OpenAI's `response_format: {"type": "json_object"}`);
    - `regex`: the output matches this regular expression in full;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a Lark grammar (llguidance's dialect; its `start` rule is the output) or a GBNF grammar (llama.cpp's,
      its `root` rule the output; vLLM's grammar backends take it), converted to Lark by llguidance;
    - `structural_tag`: free text in which tagged segments are constrained (vLLM's structural tag, for tool calls in
      running text): `{"triggers": [...], "structures": [{"begin", "schema", "end"}, ...]}` (a dict or its JSON
      text). The text is free until it reaches a trigger; from there it must be one of the structures whose `begin`
      starts with that trigger: its `begin`, a JSON value that matches its `schema`, then its `end`. Then the text is
      free again. Every `begin` must start with one of the triggers.

    `disable_any_whitespace` keeps JSON compact (no whitespace between tokens), as vLLM's option does;
    `whitespace_pattern` (vLLM's, a regular expression) is instead the whitespace JSON may have between its tokens, e.g.
    `" ?"` for at most one space (JSON constraints only: json, json_object, structural_tag).
    `disable_additional_properties` (vLLM's, for its guidance backend) makes every object of a JSON schema that lists
    `properties` and does not say otherwise take no other keys (`"additionalProperties": false`). Each token
    is drawn only from those that keep the output a prefix of something the constraint accepts (llguidance computes
    the allowed set every step); generation stops with finish_reason "stop" when the constraint is complete and
    nothing may follow, or at an allowed EOS. A schema or pattern that does not compile is an error when the request
    is added.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"StructuredOutputsParams.{name}: {why} (got {getattr(self, name)!r})")

        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: set exactly one of {', '.join(CONSTRAINT_FIELDS)} "
                             f"(got {', '.join(given) if given else 'none'})")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    raise bad("json", f"is not valid JSON text ({e})") from None
                if not isinstance(parsed, (dict, bool)):
                    raise bad("json", "must be a JSON schema (an object)")
            elif not isinstance(self.json, dict):
                raise bad("json", "must be a JSON schema: a dict or its JSON text")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex", "must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar", "must be a non-empty Lark or GBNF grammar")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise bad("choice", "must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("json_object", "must be true or false")
        if self.structural_tag is not None:
            problem = structural_tag_problem(self.structural_tag)
            if problem is not None:
                raise bad("structural_tag", problem)
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise bad("whitespace_pattern", "must be a non-empty regular expression")
            if self.json is None and not self.json_object and self.structural_tag is None:
                raise bad("whitespace_pattern", "applies to JSON only: set it with json, json_object or structural_tag")
            if self.disable_any_whitespace:
                raise bad("whitespace_pattern", "contradicts disable_any_whitespace (which allows no whitespace): "
                          "give one of them")

    @property
    def key(self) -> str:
        """A canonical text of the constraint: equal constraints compile once (engine/structured_output.py)."""
        fields = {k: getattr(self, k) for k in (*CONSTRAINT_FIELDS, "disable_any_whitespace",
                                                 "disable_additional_properties", "whitespace_pattern")}
        for name in ("json", "structural_tag"):
            if isinstance(fields[name], str):
                fields[name] = json.loads(fields[name])
        return json.dumps(fields, sort_keys=True)

    def structural_tags(self) -> list[tuple[str, str, Any, str]]:
        """The structural tag's structures as (trigger, begin, schema, end), each with the first trigger its begin
        starts with (vLLM's rule)."""
        spec = json.loads(self.structural_tag) if isinstance(self.structural_tag, str) else self.structural_tag
        assert isinstance(spec, dict)
        return [(next(t for t in spec["triggers"] if s["begin"].startswith(t)), s["begin"], s["schema"], s["end"])
                for s in spec["structures"]]


CONSTRAINT_FIELDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def structural_tag_problem(value: Any) -> str | None:
    """What is wrong with a structural tag (vLLM's `{"triggers", "structures"}` form), or None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            return f"is not valid JSON text ({e})"
    if not isinstance(value, dict):
        return 'must be an object {"triggers": [...], "structures": [{"begin", "schema", "end"}, ...]} or its JSON text'
    if "structures" not in value and "format" in value:
        return ('the {"format": ...} form (xgrammar\'s newer structural tag) is not supported: give '
                '{"triggers": [...], "structures": [{"begin", "schema", "end"}, ...]}')
    triggers, structures = value.get("triggers"), value.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        return '"triggers" must be a non-empty list of non-empty strings'
    if not isinstance(structures, list) or not structures:
        return '"structures" must be a non-empty list of {"begin", "schema", "end"} objects'
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            return f'structures[{i}] must be an object with string "begin" and "end" and a JSON schema "schema"'
        if not isinstance(s.get("schema"), dict):
            return f'structures[{i}].schema must be a JSON schema (an object)'
        if not any(s["begin"].startswith(t) for t in triggers):
            return f'structures[{i}].begin {s["begin"]!r} starts with none of the triggers {triggers}'
    return None


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 is greedy. `seed` makes a request's samples independent of whatever
    else shares its batch. `stop` strings end generation and are cut from the text.
    `logprobs=N` returns the sampled token's logprob plus the N most likely alternatives. `prompt_logprobs=N` does
    the same for every prompt token after the first (vLLM's scoring output: the first token has no context, None);
    such a request computes its whole prompt (it does not read the prefix cache), once for all n completions.
    `n` completions are sampled per prompt (the prompt is computed once and shared through the prefix cache);
    with a seed, completion i draws from `seed + i`, as in vLLM.

    Penalties, applied to the logits before temperature and the filters (vLLM's and OpenAI's definitions):
    `presence_penalty` is subtracted once from every token already generated, `frequency_penalty` once per
    occurrence; `repetition_penalty` (HF / CTRL) divides a positive logit, or multiplies a negative one, of every
    token in the prompt or the output. Logprobs stay those of the model's own logits.

    `logit_bias` ({token id: bias}, OpenAI's and vLLM's) is added to those tokens' logits before the penalties (vLLM V1's
    order). A bias outside [-100, 100] is clamped to it, as vLLM does (`SamplingParams.from_optional`); a bias that is
    not a finite number is an error. Token ids past the model's vocabulary are rejected when the request is added.

    `structured_outputs` constrains the output to a JSON schema, a regex, a list of choices or a grammar
    (StructuredOutputsParams, vLLM's name); logprobs are then those of the constrained distribution, as in vLLM.

    `truncate_prompt_tokens=k` (vLLM's) keeps only the prompt's last k tokens (left truncation) where it is longer;
    -1 keeps as many as fit (max_model_len - 1, room for one generated token). A k of max_model_len or more is
    rejected when the request is added. Without it, a prompt that does not fit is an error. A cut text prompt comes
    back with `RequestOutput.prompt` None (its text is not what the model read).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why} (got {getattr(self, name)!r})")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be a positive integer")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be a positive integer")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not (self.stop is None or isinstance(self.stop, str)
                or (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop))):
            raise bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop_list):
            raise bad("stop", "stop strings must not be empty")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a number > 0 (1 means none)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of {token id: bias}")
            for t, b in self.logit_bias.items():  # the offending entry, not the whole dict, in the message
                if not _is_int(t) or t < 0:
                    raise ValueError(f"SamplingParams.logit_bias: keys must be non-negative integer token ids "
                                     f"(got {t!r})")
                if not (_is_int(b) or _is_number(b)):  # _is_int first: math.isfinite(10**400) overflows
                    raise ValueError(f"SamplingParams.logit_bias: values must be finite numbers (got {b!r} for {t})")
            # a copy: dataclasses.replace (n > 1 completions) and the caller's own dict stay independent
            self.logit_bias = {int(t): float(min(100, max(-100, b))) for t, b in self.logit_bias.items()}
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise bad("truncate_prompt_tokens", "must be a positive integer, or -1 (as many as fit)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def stop_list(self) -> list[str]:
        """`stop` as a list, read from the field each time: setting `stop` after construction works, as in vLLM."""
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop) if self.stop else []

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily, as in vLLM (dividing by them overflows)."""
        return self.temperature < GREEDY_BELOW


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """A finite int or float (NaN passes every comparison the checks above make as False, or True)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
