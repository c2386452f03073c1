"""Results handed back to users, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log probability under the model's own logits, its rank among the vocabulary
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    # One dict per generated token: {token_id: Logprob}, the sampled token first, then the top alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
