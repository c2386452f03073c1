"""Where the model runs: in this process (TP=1) or across tensor-parallel worker processes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nvcli.config import EngineConfig
from nvcli.engine.model_runner import ModelRunner, StepHandle, StepResult, TokenMaskHook, build_step_input
from nvcli.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from nvcli.kernels.compile_ahead import CompileWorkers
    from nvcli.models.model_config import ModelConfig


class Executor(Protocol):
    num_kvcache_blocks: int
    supports_async: bool  # launch may run ahead of collect (inputs fed back on the device)

    def launch(self, batch: ScheduledBatch, prev: StepHandle | None, token_masks: TokenMaskHook | None = None
               ) -> StepHandle: ...

    def collect(self, handle: StepHandle) -> StepResult: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    supports_async = True

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path,
                 compile_workers: CompileWorkers | None = None) -> None:
        self.runner = ModelRunner(config, model_config, model_dir, compile_workers=compile_workers)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.block_size = config.kvcache_block_size

    def launch(self, batch: ScheduledBatch, prev: StepHandle | None, token_masks: TokenMaskHook | None = None
               ) -> StepHandle:
        step = build_step_input(batch, self.block_size, prev.row_of if prev is not None else None)
        return self.runner.launch(batch, step, token_masks)

    def collect(self, handle: StepHandle) -> StepResult:
        return self.runner.collect(handle)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, model_config: ModelConfig, model_dir: Path, compile_workers: CompileWorkers | None = None
                  ) -> Executor:
    """`compile_workers`: rank 0's, started early by the engine (model_runner.start_compile_workers_if_cold)."""
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config, model_config, model_dir, compile_workers)
    from nvcli.engine.tp_executor import TensorParallelExecutor

    return TensorParallelExecutor(config, model_config, model_dir, compile_workers)
