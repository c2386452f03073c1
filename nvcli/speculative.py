"""vLLM's `--speculative-config`: typed and validated at construction, every error naming the flag.

Two methods: prompt lookup (`{"method": "ngram", ...}`, engine/spec_decode.py) and a draft model
(`{"model": DIR, "num_speculative_tokens": k}`, method "draft_model" implied; engine/draft_model.py). The draft's
directory and vocabulary are checked where the target's model is known (the engine's start). Errors are ValueErrors;
EngineConfig raises them as ConfigErrors (this module does not import config.py, which imports it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

FLAG = "--speculative-config"
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a verify row computes 1 + k tokens; more than this is never accepted in practice
# Speculate only in steps with at most this many running sequences: a bigger batch keeps the device busy without
# drafts, and a verify step gives up async scheduling's overlap (it needs the last token known)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0  # k: drafts proposed per sequence and step (required)
    # the longest and shortest suffix n-gram looked up in the sequence's own tokens; vLLM's defaults: both 5 where
    # neither is given, the given one where one is
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # draft_model: a model sharing the target's tokenizer (a directory, a GGUF file, a hub id in the local cache, or
    # with --load-format dummy whatever names the target's shapes); loaded with the target's load format
    model: str | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, why: str) -> None:
            if not ok:
                raise ValueError(f"{FLAG}: {why}")

        need(self.method in METHODS, f"method must be one of {', '.join(METHODS)} (got {self.method!r})")
        need((self.model is not None) == (self.method == "draft_model"),
             'a draft model is {"model": DIR, "num_speculative_tokens": k} (method draft_model, or left out); '
             "method ngram takes no model")
        need(self.model is None or (isinstance(self.model, str) and self.model != ""),
             f"model must name the draft model's directory (got {self.model!r})")
        need(self.model is None or (self.prompt_lookup_min is None and self.prompt_lookup_max is None),
             "prompt_lookup_min / prompt_lookup_max go with method ngram, not with a draft model")
        need(_pos_int(self.num_speculative_tokens) and self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS} "
             f"(got {self.num_speculative_tokens!r})")
        if self.method == "ngram":  # resolved here; a draft model keeps both None
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                need(v is None or _pos_int(v), f"{name} must be a positive integer (got {v!r})")
            if lo is None and hi is None:
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            need(lo <= hi, f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")  # type: ignore[operator]
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        need(_pos_int(self.disable_by_batch_size),
             f"disable_by_batch_size must be a positive integer (got {self.disable_by_batch_size!r})")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def speculative_config(value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
    """The flag's value (a JSON object as text, a dict, or a SpeculativeConfig) as a SpeculativeConfig; None stays
    None. Unknown keys are refused, naming the flag; `{"model": ...}` without a method is method draft_model."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{FLAG}: not valid JSON ({e.msg}); e.g. "
                                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"{FLAG}: must be a JSON object (got {type(value).__name__})")
    if "model" in value and "method" not in value:
        value = {**value, "method": "draft_model"}
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{FLAG}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if "num_speculative_tokens" not in value:
        raise ValueError(f"{FLAG}: needs num_speculative_tokens (drafts per step, e.g. 4)")
    return SpeculativeConfig(**value)


def _pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
