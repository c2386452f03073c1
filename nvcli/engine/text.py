"""The engine's text side: tokenizer calls, chat templates and token texts, shared by the engine and by the
data-parallel front end (which tokenizes once for all its replicas)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvcli.config import ConfigError
from nvcli.models.tokenizer import extend_vocabulary, vocabulary_texts
from nvcli.reasoning import THINK_END, THINK_START

if TYPE_CHECKING:
    from nvcli.models.model_config import ModelConfig


class TextSide:
    """encode_batch / render_chat_text / token_texts over `self.tokenizer` and `self.model_config` (the Engine
    protocol's text members)."""

    tokenizer: Any
    model_config: ModelConfig
    _token_texts: list[str] | None = None

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text, in one tokenizer call: the tokenizer spreads a batch over the CPU's
        cores outside the GIL, where one call per text holds it (prompt-heavy jobs, benchmarks/RESULTS.md)."""
        return self.tokenizer(texts, add_special_tokens=add_special_tokens).input_ids if texts else []

    def render_chat_text(self, messages: list[dict], chat_template_kwargs: dict | None = None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         tools: list[dict] | None = None) -> str:
        """The chat template applied to `messages` (and the `tools` offered, OpenAI function objects), with the
        assistant's turn opened (or, with `continue_final_message`, the last message left open to be continued); not
        tokenized. A `chat_template` in `chat_template_kwargs` replaces the tokenizer's."""
        if getattr(self.tokenizer, "chat_template", None) is None and not (chat_template_kwargs or {}).get("chat_template"):
            raise ValueError("this model's tokenizer has no chat template; send {'prompt': ...} instead of messages")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {})
        )

    def render_chat(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
        text = self.render_chat_text(messages, chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def token_texts(self) -> list[str]:
        """Every token id's text alone (vLLM's decoded_token), by id, for every id the model reads or writes: the
        logprobs' texts are read from it (outputs.FlatLogprobs.use_vocabulary), and a job's formatting processes get
        it. The whole vocabulary is decoded once, in one call, the first time logprobs need texts: a scoring job, or
        a random model's outputs, meet ids from all over it, and one decode call per new id held the engine thread
        for milliseconds whenever several sequences finished at once. Ids past the tokenizer's (a model's padded
        vocabulary) are decoded one by one then."""
        if self._token_texts is None:
            self._token_texts = extend_vocabulary(vocabulary_texts(self.tokenizer), self.tokenizer,
                                                  self.model_config.vocab_size - 1)
        return self._token_texts


def reasoning_markers(tokenizer: Any, parser: str | None) -> tuple[int, int] | None:
    """The token ids of `<think>` and `</think>` for --reasoning-parser; None without one."""
    if parser is None:
        return None
    vocab = tokenizer.get_vocab()
    missing = [m for m in (THINK_START, THINK_END) if m not in vocab]
    if missing:
        raise ConfigError(f"--reasoning-parser={parser}: the tokenizer has no {' or '.join(missing)} token, so this "
                          "model does not reason in those markers (leave the flag out)")
    return vocab[THINK_START], vocab[THINK_END]


def eos_token_ids(model_dir: Path, model_config: ModelConfig, tokenizer: Any) -> set[int]:
    """Every id that ends a completion: generation_config.json's, config.json's and the tokenizer's EOS."""
    ids: set[int] = set()

    def add(x: object) -> None:
        if isinstance(x, int):
            ids.add(x)
        elif isinstance(x, (list, tuple)):
            ids.update(i for i in x if isinstance(i, int))

    gen = model_dir / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(model_config.eos_token_id)
    add(tokenizer.eos_token_id)
    return ids
