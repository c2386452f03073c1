"""nv's engine inside Ray Data, for users whose data is already a Ray Dataset (in the shape of ray.data.llm's
processors):

    import ray
    from nvcli.ray_data import build_nv_processor

    processor = build_nv_processor(model="/models/Qwen3-8B", concurrency=4, num_gpus=1,
                                   sampling_params={"temperature": 0.0, "max_tokens": 256})
    ds = processor(ray.data.read_json("prompts.jsonl"))  # rows with "prompt" (or chat "messages")
    ds.write_json("out")  # + generated_text, num_generated_tokens, finish_reason

Each of the `concurrency` actors holds one engine (its GPUs: `num_gpus`, e.g. the --tp size) and generates a batch of
rows at a time. Ray Data retries a failed batch on another actor; `nv generate --dp-backend ray` is the tool for a
JSONL job (one output line per input line, resume, dashboard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nvcli.sampling_params import SamplingParams


class NvProcessor:
    """A callable class for `Dataset.map_batches`: rows with a `prompt_column` (text) or a `messages_column` (a chat)
    in, the same rows with `generated_text`, `num_generated_tokens` and `finish_reason` out. Other keyword arguments
    are LLM's (EngineConfig's)."""

    def __init__(self, model: str | None = None, sampling_params: dict | None = None, prompt_column: str = "prompt",
                 messages_column: str = "messages", **engine_kwargs: Any) -> None:
        from nvcli.llm import LLM

        self.llm = LLM(model, **engine_kwargs)
        self.params = SamplingParams(**(sampling_params or {}))
        self.prompt_column = prompt_column
        self.messages_column = messages_column

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.messages_column in batch:
            outs = self.llm.chat([list(m) for m in batch[self.messages_column]], self.params)
        elif self.prompt_column in batch:
            outs = self.llm.generate([str(p) for p in batch[self.prompt_column]], self.params)
        else:
            raise ValueError(f"each row needs a {self.prompt_column!r} or {self.messages_column!r} column "
                             f"(got {sorted(batch)})")
        batch = dict(batch)
        batch["generated_text"] = [o.outputs[0].text for o in outs]
        batch["num_generated_tokens"] = [len(o.outputs[0].token_ids) for o in outs]
        batch["finish_reason"] = [o.outputs[0].finish_reason for o in outs]
        return batch


def build_nv_processor(model: str | None = None, concurrency: int = 1, num_gpus: float = 1, batch_size: int = 64,
                       sampling_params: dict | None = None, **engine_kwargs: Any) -> Callable[[Any], Any]:
    """A function Dataset -> Dataset running NvProcessor on `concurrency` actors of `num_gpus` GPUs each."""

    def process(ds: Any) -> Any:
        return ds.map_batches(NvProcessor, fn_constructor_kwargs={"model": model, "sampling_params": sampling_params,
                                                                  **engine_kwargs},
                              concurrency=concurrency, num_gpus=num_gpus, batch_size=batch_size)

    return process
