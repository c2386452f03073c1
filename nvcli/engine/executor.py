"""Where the model runs: in this process (TP=1) or across tensor-parallel worker processes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nvcli.config import EngineConfig
from nvcli.engine.model_runner import ModelRunner
from nvcli.engine.sampling_stage import SamplingInputs, StepHandle, StepResult, TokenMasks, collect
from nvcli.engine.scheduler import ScheduledBatch
from nvcli.engine.step_input import build_step_input

if TYPE_CHECKING:
    from nvcli.kernels.compile_ahead import CompileWorkers
    from nvcli.models.model_config import ModelConfig


class Executor(Protocol):
    num_kvcache_blocks: int
    supports_async: bool  # launch may run ahead of collect (inputs fed back on the device)

    def launch(self, batch: ScheduledBatch, prev: StepHandle | None) -> StepHandle:
        """Enqueue `batch`'s forward and logits; `prev`: the step in flight, whose tokens feed pending inputs."""
        ...

    def sample(self, handle: StepHandle, masks: TokenMasks | None = None) -> None:
        """Enqueue a launched step's sampling (`masks`: structured outputs' allowed tokens of some rows)."""
        ...

    def collect(self, handle: StepHandle) -> StepResult: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    supports_async = True

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path,
                 compile_workers: CompileWorkers | None = None) -> None:
        self.runner = ModelRunner(config, model_config, model_dir, compile_workers=compile_workers)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.block_size = config.kvcache_block_size

    def launch(self, batch: ScheduledBatch, prev: StepHandle | None) -> StepHandle:
        step = build_step_input(batch, self.block_size, prev.row_of if prev is not None else None)
        return self.runner.launch(step, SamplingInputs.of(batch))

    def sample(self, handle: StepHandle, masks: TokenMasks | None = None) -> None:
        self.runner.sample(handle, masks)

    def collect(self, handle: StepHandle) -> StepResult:
        return collect(handle)

    def shutdown(self) -> None:
        self.runner.release_cuda_graphs()


def make_executor(config: EngineConfig, model_config: ModelConfig, model_dir: Path, compile_workers: CompileWorkers | None = None
                  ) -> Executor:
    """`compile_workers`: rank 0's, started early by the engine (startup.start_compile_workers_if_cold)."""
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config, model_config, model_dir, compile_workers)
    from nvcli.engine.tp_executor import TensorParallelExecutor

    return TensorParallelExecutor(config, model_config, model_dir, compile_workers)
