"""Where the model runs: in this process (TP=1) or across tensor-parallel worker processes."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from nvcli.config import EngineConfig
from nvcli.engine.model_runner import ModelRunner, build_step_input
from nvcli.engine.scheduler import ScheduledBatch


class Executor(Protocol):
    num_kvcache_blocks: int

    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[dict[int, float] | None]]: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    def __init__(self, config: EngineConfig, hf_config, model_dir: Path) -> None:
        self.runner = ModelRunner(config, hf_config, model_dir)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.block_size = config.kvcache_block_size

    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[dict[int, float] | None]]:
        logits = self.runner.execute(build_step_input(batch, self.block_size))
        assert logits is not None
        return self.runner.sample(logits, batch)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, hf_config, model_dir: Path) -> Executor:
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config, hf_config, model_dir)
    from nvcli.engine.tp_executor import TensorParallelExecutor

    return TensorParallelExecutor(config, hf_config, model_dir)
