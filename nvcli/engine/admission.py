"""Admission: the limits the engine runs under, resolved once from the settings and the model, and each request
checked against them and turned into its sequences (one per completion) before it reaches the scheduler.

Every check raises ValueError with a message that says what to change; nothing is queued for a request that fails.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

from nvcli.config import ConfigError, EngineConfig
from nvcli.engine.sequence import Sequence
from nvcli.outputs import FlatLogprobs
from nvcli.reasoning import reasoning_ended
from nvcli.sampling_params import SamplingParams
from nvcli.token_ids import valid_token_ids

if TYPE_CHECKING:
    from nvcli.engine.structured_output import GrammarCompiler
    from nvcli.models.model_config import ModelConfig

log = logging.getLogger("nvcli")


def resolve_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """The settings with what the model decides filled in: max_model_len (the model's positions, or its sliding
    window, which nv does not implement) and async scheduling (on where there is something to overlap: a GPU)."""
    max_pos = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > max_pos:
        raise ConfigError(f"--max-model-len={config.max_model_len} exceeds the model's {max_pos} positions")
    window = model_config.sliding_window
    if window is not None and window < max_pos:
        # the kernels attend to the whole context: the same as the model's sliding layers only within the window
        if config.max_model_len is not None and config.max_model_len > window:
            raise ConfigError(
                f"--max-model-len={config.max_model_len} exceeds the model's sliding attention window of {window} "
                f"tokens (config.json use_sliding_window), which nv does not implement; lower it to at most {window}"
            )
        if config.max_model_len is None:
            log.warning("max_model_len capped to the model's sliding attention window of %d tokens", window)
        max_pos = window
    async_scheduling = config.async_scheduling
    if async_scheduling is None:
        async_scheduling = config.resolved_device() == "cuda"
    return dataclasses.replace(config, max_model_len=config.max_model_len or max_pos, async_scheduling=async_scheduling)


def fit_cache(config: EngineConfig, num_blocks: int, explicit_len: bool) -> int:
    """max_model_len once the KV cache is sized: a sequence must fit the whole cache."""
    capacity = num_blocks * config.kvcache_block_size
    assert config.max_model_len is not None
    if capacity >= config.max_model_len:
        return config.max_model_len
    room = "--cpu-kvcache-space" if config.resolved_device() == "cpu" else "--gpu-memory-utilization"
    if explicit_len:
        raise ConfigError(
            f"--max-model-len={config.max_model_len}: the KV cache holds only {capacity} tokens "
            f"({num_blocks} blocks); lower it, or raise {room} / --num-kvcache-blocks"
        )
    log.warning("max_model_len capped to the KV cache's %d tokens (%s makes it larger)", capacity, room)
    return capacity


@dataclasses.dataclass
class Admitted:
    """A request that passed admission: its sequences, the text to return as its prompt, and whether completions
    1..n-1 wait for completion 0's prompt blocks (prefix caching shares a full block)."""

    seqs: list[Sequence]
    prompt: str | None
    hold: bool
    constrained: bool


class Admission:
    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int, max_model_len: int,
                 eos_token_ids: set[int], reasoning_markers: tuple[int, int] | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.reasoning_markers = reasoning_markers
        self.compiler: GrammarCompiler | None = None  # structured outputs: made at the first such request
        self._lock = threading.Lock()  # requests may come from a reader thread

    def structured_outputs(self) -> GrammarCompiler:
        """The grammar compiler of structured outputs, made at its first use."""
        with self._lock:
            if self.compiler is None:
                from nvcli.engine.structured_output import GrammarCompiler

                self.compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self.compiler

    def admit(self, prompt: str | list[int], params: SamplingParams, prompt_text: str | None = None,
              priority: int = 0) -> Admitted:
        """Check a request (`check`) and make its sequences."""
        token_ids, text, grammar = self.check(prompt, params, prompt_text, priority)
        compiler = self.compiler if grammar is not None else None
        # a constraint waits for the reasoning to end (--reasoning-parser, vLLM's rule) unless it is to hold in the
        # reasoning too (--structured-outputs-in-reasoning)
        thinking = (grammar is not None and self.reasoning_markers is not None
                    and not self.config.structured_outputs_in_reasoning
                    and not reasoning_ended(token_ids, *self.reasoning_markers))
        banned: tuple[int, ...] = ()
        if params.min_tokens:  # the same for every completion
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            banned = tuple(sorted(ends))
        seqs = [Sequence(token_ids, sp, self.config.kvcache_block_size, priority=priority)
                for sp in completion_params(params)]
        for index, seq in enumerate(seqs):
            seq.completion_index = index
            seq.min_tokens_banned = banned
            if compiler is not None and grammar is not None:
                seq.grammar = compiler.new_state(grammar, self.reasoning_markers[1] if thinking else None)
        if params.prompt_logprobs is not None:  # once per request: by the completion that computes the prompt
            seqs[0].num_prompt_logprobs_wanted = len(token_ids) - 1
            seqs[0].prompt_logprobs = FlatLogprobs()
            seqs[0].prompt_logprobs.append_empty()  # the first prompt token: nothing predicts it
        # siblings wait for the first completion's prompt blocks only where the cache can share a full block
        hold = self.config.enable_prefix_caching and len(token_ids) > self.config.kvcache_block_size
        return Admitted(seqs, text, hold, grammar is not None)

    def check(self, prompt: str | list[int], params: SamplingParams, prompt_text: str | None = None,
              priority: int = 0) -> tuple[list[int], str | None, Any]:
        """Check a request: (its token ids, after truncate_prompt_tokens; the text they spell, None where truncated;
        its compiled constraint or None). `prompt` is text (tokenized here) or token ids; with token ids,
        `prompt_text` is the text they came from. `priority`: see check_priority. The data-parallel front end checks
        requests this way; each replica admits them."""
        check_priority(priority, self.config.scheduling_policy)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids, text = self.tokenizer(prompt).input_ids, prompt
        else:
            token_ids, text = list(prompt), prompt_text
            if not valid_token_ids(token_ids, self.vocab_size):
                raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
        if not token_ids:
            raise ValueError("prompt is empty")
        kept = self.truncated(token_ids, params.truncate_prompt_tokens, params.max_tokens)
        if len(kept) < len(token_ids):  # the text no longer spells the tokens the model reads
            token_ids, text = kept, None
        if params.logit_bias:
            outside = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            if outside:  # an index past the logits' width: the sampler's index_put_ would fail mid-step
                shown = ", ".join(map(str, outside[:8])) + (", ..." if len(outside) > 8 else "")
                raise ValueError(f"logit_bias: token id(s) {shown} are outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate "
                "(shorten the prompt or raise --max-model-len)"
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            # vLLM's 400: such a request could never finish as asked
            raise ValueError(f"max_tokens={params.max_tokens} is too large: the prompt has {len(token_ids)} tokens and "
                             f"max_model_len={self.max_model_len} leaves room for {self.max_model_len - len(token_ids)} "
                             "more (lower max_tokens or shorten the prompt)")
        grammar: Any = None
        if params.structured_outputs is not None:  # compiled (and checked) once for all completions
            grammar = self.structured_outputs().grammar(params.structured_outputs)
        return token_ids, text, grammar

    def truncated(self, token_ids: list[int], keep: int | None, max_tokens: int | None = None) -> list[int]:
        """The prompt's last `keep` tokens (SamplingParams.truncate_prompt_tokens; -1: as many as leave room for
        max_tokens, or for one generated token without it)."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = max(1, self.max_model_len - max(1, max_tokens or 1))
        elif keep >= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={keep} must be below max_model_len={self.max_model_len} (-1 keeps "
                             "as many tokens as fit)")
        return token_ids[-keep:] if len(token_ids) > keep else token_ids


def check_priority(priority: int, policy: str) -> None:
    """A request's priority (vLLM's): an integer, lower served first. Anything but 0 needs `--scheduling-policy
    priority`; vLLM's engine refuses it otherwise, rather than silently serving the request in arrival order."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer (lower is served first), got {priority!r}")
    if priority and policy != "priority":
        raise ValueError(f"priority={priority}: priority scheduling is not enabled (pass --scheduling-policy priority)")


def completion_params(sp: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per completion: n=1 each; with a seed, completion i draws from seed + i (vLLM)."""
    if sp.n == 1:
        return [sp]
    return [dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i) for i in range(sp.n)]
