"""The engine as the job machinery (nvcli/jobs/), the offline API and the dashboard see it: one typed protocol.

LLMEngine implements it; so does anything that stands in for an engine (the tests' fake engine, a front end over
data-parallel replicas). Callers use these members only, never the engine's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nvcli.config import EngineConfig
from nvcli.outputs import RequestOutput
from nvcli.sampling_params import SamplingParams


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    prompt_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int
    num_steps: int
    last_step_time_s: float
    num_finished: int
    num_chunked_prefills: int = 0
    # Cumulative wall seconds per phase of step(): where host time goes.
    schedule_s: float = 0.0
    execute_s: float = 0.0
    postprocess_s: float = 0.0
    num_decode_steps: int = 0
    # Speculative decoding (--speculative-config): drafts verified and accepted, sequences' verifications (a
    # sequence's step with drafts; it adds 1 + its accepted drafts) and engine steps that verified any
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_rows: int = 0
    spec_verify_steps: int = 0
    # Data parallelism: each replica's own (None: a replica gone or not heard from yet); the fields above are sums
    replicas: list[EngineStats | None] | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0


class Engine(Protocol):
    tokenizer: Any  # a transformers tokenizer: encode / decode, chat_template, name_or_path
    model_dir: Path  # where the model's files are (config.json, generation_config.json)
    max_model_len: int  # prompt + output tokens of one request
    config: EngineConfig  # the settings, resolved against the model

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, in one tokenizer call."""
        ...

    def render_chat_text(self, messages: list[dict], chat_template_kwargs: dict | None = None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         tools: list[dict] | None = None) -> str:
        """The chat template applied to `messages` (and `tools`), not tokenized."""
        ...

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str | None = None,
                    prompt_text: str | None = None, priority: int = 0) -> str:
        """Queue a request (safe from another thread than the one stepping); ValueError says why it cannot be.
        `priority` (vLLM's): lower is served first under --scheduling-policy priority; other than 0 it is an error
        under fcfs."""
        ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Run one step; the requests it finished."""
        ...

    def stats(self) -> EngineStats: ...

    def token_texts(self) -> list[str]:
        """Every token id's text alone, by id (logprobs' decoded tokens)."""
        ...

    def shutdown(self) -> None: ...
