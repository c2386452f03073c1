"""The engine: one LLMEngine, or a front end over data-parallel replicas of it (data_parallel.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nvcli.config import EngineConfig
    from nvcli.engine.protocol import Engine


def build_engine(config: EngineConfig) -> Engine:
    """The engine for these settings: replicas behind a front end where data parallelism asks for them."""
    if config.data_parallel_size > 1 or config.data_parallel_backend == "ray":
        from nvcli.engine.data_parallel import DataParallelEngine

        return DataParallelEngine(config)
    from nvcli.engine.llm_engine import LLMEngine

    return LLMEngine(config)
