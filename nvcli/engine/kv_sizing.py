"""KV-cache sizing at start-up: how many blocks fit, measured with the largest step a job can schedule.

A draft model's cache (speculative decoding) is sized with the target's, block for block.
On a GPU the profile run executes a worst-case step (max_num_batched_tokens tokens; on rank 0 every sampling feature
on every row and the largest penalty pool; a scoring chunk of prompt logprobs), then the cache gets what
gpu_memory_utilization leaves after that peak and the CUDA graphs' pool. On the CPU the cache holds
max_model_len x max_num_seqs tokens, bounded by cpu_kvcache_space_gib."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from nvcli.config import ConfigError
from nvcli.engine.penalties import PenaltyBatch
from nvcli.engine.sampler import SamplingBatch, logprob_rows, sample, sampled_token_logprobs, token_logprobs
from nvcli.engine.step_input import Final, StepInput
from nvcli.kernels.kv_layout import allocate_kv_cache
from nvcli.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from nvcli.config import EngineConfig
    from nvcli.engine.cuda_graphs import CudaGraphs
    from nvcli.engine.sampling_stage import SamplingStage
    from nvcli.models.layers.attention import Attention
    from nvcli.models.model_config import ModelConfig

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Runner(Protocol):
    """What start-up reads and sets of the model runner (engine/model_runner.ModelRunner)."""

    config: EngineConfig
    model_config: ModelConfig
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    rank: int
    block_size: int
    max_table_width: int  # blocks in a max_model_len sequence's table
    logit_chunk_rows: int
    attn_layers: list[Attention]
    cuda_graphs: CudaGraphs | None
    sampling: SamplingStage
    kv_cache: torch.Tensor  # set here
    num_kvcache_blocks: int

    def forward(self, step: StepInput) -> Final: ...

    def prompt_logit_chunks(self, rows: Final) -> Iterator[torch.Tensor]: ...


def kv_bytes_per_block(runner: Runner) -> int:
    layer = runner.attn_layers[0]
    elem = torch.tensor([], dtype=kv_dtype(runner)).element_size()
    return 2 * len(runner.attn_layers) * runner.block_size * layer.num_kv_heads * layer.head_dim * elem


def draft_kv_bytes_per_block(config: EngineConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of a draft model's KV cache, kept in `dtype` (the target's compute dtype, whatever
    --kv-cache-dtype says: engine/draft_model.py)."""
    from nvcli.models.model_config import load_model_config
    from nvcli.models.resolve import resolve_model

    model = getattr(config.speculative_config, "model", None)
    assert model is not None
    cfg = load_model_config(resolve_model(model, config.load_format))
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def kv_dtype(runner: Runner) -> torch.dtype:
    name = runner.config.kv_cache_dtype
    if name.startswith("fp8"):
        return torch.float8_e4m3fn
    return TORCH_DTYPES.get(name, runner.dtype)  # "auto": the model's dtype


def allocate(runner: Runner) -> int:
    """Size the KV cache (a fixed count, the CPU's budget, or what free GPU memory leaves after a worst-case step),
    allocate it and bind each attention layer's PagedKV (pages and fp8 scales); the number of blocks."""
    per_block = kv_bytes_per_block(runner)
    spec = runner.config.speculative_config
    if runner.rank == 0 and getattr(spec, "model", None) is not None:
        # a draft model's cache has as many blocks, in rank 0's process (engine/draft_model.py): both must fit. Its
        # weights are loaded before this runs (used memory on a GPU); its forwards come between the target's and are
        # smaller than the profiled step, so they fit in the activation room that step leaves
        per_block += draft_kv_bytes_per_block(runner.config, runner.block_size, runner.dtype)
    if runner.config.num_kvcache_blocks is not None:
        num_blocks = runner.config.num_kvcache_blocks
    elif runner.device.type == "cpu":
        max_len = runner.config.max_model_len or runner.model_config.max_position_embeddings
        wanted = -(-max_len // runner.block_size) * runner.config.max_num_seqs
        num_blocks = max(1, min(wanted, int(runner.config.cpu_kvcache_space_gib * 2**30) // per_block))
    else:
        num_blocks = blocks_from_free_memory(runner, per_block)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        agreed = torch.tensor([num_blocks], device=runner.device if runner.device.type == "cuda" else "cpu")
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)  # every rank the same size
        num_blocks = int(agreed.item())
    layer = runner.attn_layers[0]
    try:
        # [2, num_layers, num_blocks, page elements]; each layer's K and V are page views of it (kv_layout.py)
        runner.kv_cache, caches = allocate_kv_cache(len(runner.attn_layers), num_blocks, runner.block_size,
                                                  layer.num_kv_heads, layer.head_dim, kv_dtype(runner), runner.device,
                                                  runner.config.kv_cache_scale)
    except torch.OutOfMemoryError as e:
        raise ConfigError(
            f"--num-kvcache-blocks / --gpu-memory-utilization: {num_blocks} KV blocks "
            f"({num_blocks * per_block / 2**30:.1f} GiB) do not fit in device memory"
        ) from e
    for attn, kv in zip(runner.attn_layers, caches):
        attn.kv = kv  # the job's binding: the CUDA graphs, captured after this, read its scales in place
    return num_blocks


def blocks_from_free_memory(runner: Runner, per_block: int) -> int:
    """Measure the peak of a worst-case step, then give the KV cache what utilization allows."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    profile_run(runner, worst_case=True)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    peak = torch.cuda.max_memory_allocated()
    current = torch.cuda.memory_allocated()
    # Activations of the worst step come back on every step; the graph pool holds about one
    # decode step's worth (graphs of all sizes share it).
    graph_pool = 0 if runner.config.enforce_eager else graph_activation_bytes(runner)
    budget = total * runner.config.gpu_memory_utilization - used - (peak - current) - graph_pool
    num_blocks = int(budget) // per_block
    if num_blocks < 1:
        raise ConfigError(
            f"--gpu-memory-utilization={runner.config.gpu_memory_utilization}: no memory left for the KV cache "
            f"(device {total / 2**30:.1f} GiB, in use {used / 2**30:.1f} GiB, step peak "
            f"{(peak - current) / 2**30:.1f} GiB); raise it or lower --max-num-batched-tokens"
        )
    return num_blocks


def graph_activation_bytes(runner: Runner) -> int:
    """Activation bytes of the largest CUDA graph (decode or mixed): the graphs' shared pool holds about that."""
    graphs = runner.cuda_graphs
    assert graphs is not None
    bs = max([graphs.decode_sizes[-1], *graphs.mixed_sizes])
    hidden = runner.model_config.hidden_size
    cfg, tp = runner.model_config, max(1, runner.model.tp_size)
    inter = cfg.intermediate_size // tp
    if cfg.num_experts:  # a MoE layer's rows go to top-k experts: gate_up, activation and down rows for each, padded
        # (FP8 experts hold an fp8 copy of each token's hidden row beside fp8 activations, well inside this count)
        inter = max(inter, cfg.num_experts_per_tok * (cfg.moe_intermediate_size // tp + hidden))
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    # the logits of the graphs that end with the LM head stay allocated beside it, one tensor per graph size
    logit_rows = sum(s for s in graphs.decode_sizes if s <= graphs.logits_max_rows)
    return bs * (6 * hidden + 3 * inter) * elem + logit_rows * runner.model_config.vocab_size * elem + (64 << 20)


def largest_prefill(runner: Runner) -> tuple[StepInput, int]:
    """The largest prompt step a job can schedule (max_num_batched_tokens tokens, in sequences of at most
    max_model_len) and the cache blocks each of its sequences reads. It writes nothing (slot -1)."""
    n = min(runner.config.max_num_batched_tokens, (runner.config.max_model_len or 4096) * runner.config.max_num_seqs)
    seq_len = min(n, runner.config.max_model_len or n)
    num_seqs = -(-n // seq_len)
    blocks = -(-seq_len // runner.block_size)
    qsl = [min(i * seq_len, n) for i in range(num_seqs + 1)]
    step = StepInput([0] * n, [i % seq_len for i in range(n)], [-1] * n, qsl,
                     [qsl[i + 1] - qsl[i] for i in range(num_seqs)], [list(range(blocks))] * num_seqs, False)
    return step, blocks


def most_verify_rows(config: EngineConfig) -> int:
    """The most rows a verify step samples (0 without speculative decoding): 1 + k per sequence, in steps of at most
    disable_by_batch_size running sequences."""
    spec = config.speculative_config
    return 0 if spec is None else min(spec.disable_by_batch_size, config.max_num_seqs) * (1 + spec.k)


def most_sampled_rows(config: EngineConfig) -> int:
    """The most rows a step samples: one per running sequence, or a verify step's rows."""
    return max(config.max_num_seqs, most_verify_rows(config))


@torch.inference_mode()
def run_largest_prefill(runner: Runner, step: StepInput, worst_case: bool = False) -> None:
    """`worst_case` (the KV-sizing profile run): rank 0 holds the penalty pool at the size that max_num_seqs
    penalized sequences grow it to and samples the logits with every feature on every row; then, with those
    logits still alive as in a step, every rank runs a scoring chunk (prompt_logprobs) of the step's rows."""
    pool = largest_penalty_pool(runner) if worst_case and runner.rank == 0 else None
    hidden, residual = runner.forward(step)
    # the step's few sequence rows repeated to the most rows a step samples: their logits and sampling scratch
    rows = torch.arange(most_sampled_rows(runner.config), device=hidden.device) % hidden.shape[0]
    logits = runner.model.compute_logits(hidden[rows], residual[rows] if residual is not None else None)
    if pool is not None:
        sample_worst_case(runner, logits, counts=pool[0], seen=pool[1])
    if worst_case:
        score_worst_case(runner, hidden, residual)
    del hidden, residual, logits, pool


def score_worst_case(runner: Runner, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """A step's scoring work at its largest: the prompt rows gathered (a copy, as `_logit_rows` makes), their
    logits a chunk of PROMPT_LOGITS_CHUNK_BYTES, and rank 0's reduction of it to logprobs, ranks and the most
    alternatives. A scoring job with few sequences (little to sample) would otherwise meet a chunk of 256 MB that
    KV sizing never saw. Every rank computes the chunk (the LM head gathers the vocab across ranks)."""
    n = runner.logit_chunk_rows  # a step pads its prompt rows to whole chunks (_logit_rows)
    index = torch.arange(n, device=runner.device) % hidden.shape[0]
    extra = (hidden[index], None if residual is None else residual[index])
    chunks = runner.prompt_logit_chunks(extra)
    if runner.rank == 0:
        token_logprobs(chunks, torch.zeros(n, dtype=torch.int64, device=runner.device), MAX_LOGPROBS, runner.device)
    else:
        for _ in chunks:
            pass


def largest_penalty_pool(runner: Runner) -> list[torch.Tensor]:
    """PenaltySlots' history tensors (counts int32, seen bool: [slots, vocab]) at the size max_num_seqs held
    sequences grow them to, then the half-size pair the last doubling copied them from, which the step that grows
    the pool holds as well; with speculative decoding, then a verify step's step-local history rows (a pair of
    [verify rows, vocab]: PenaltySlots._verify_batch), which it holds beside the pool."""
    config = runner.config
    slots = runner.sampling.penalty_slots.slots_for(config.max_num_seqs)
    sizes = [slots, slots // 2]
    if config.speculative_config is not None:
        sizes.append(most_verify_rows(config))
    vocab = runner.model_config.vocab_size
    return [torch.zeros((n, vocab), dtype=dtype, device=runner.device)
            for n in sizes for dtype in (torch.int32, torch.bool)]


def sample_worst_case(runner: Runner, logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> None:
    """Sample `logits` [rows, vocab] as a step whose every row asks for every sampling feature: logit_bias and
    the penalties (each a float32 copy of the logits), top-k / top-p / min-p (the floor kernel's scratch) and
    the most logprobs. The profile run's peak then covers what a job's sampler allocates beside its logits;
    without it a job at a --gpu-memory-utilization near 1 could run out of memory at its first penalized step."""
    rows, vocab = logits.shape
    index = torch.arange(rows, device=runner.device)
    ones = torch.ones(rows, dtype=torch.float32, device=runner.device)
    # a verify step samples more rows than the pool has slots (they read step-local history rows, allocated with
    # the pool above): here they share the pool's slots, which reads as much memory
    penalties = PenaltyBatch(rows=index, slots=index % counts.shape[0], presence=ones, frequency=ones,
                             repetition=ones * 1.1, counts=counts, seen=seen)
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05, logit_bias={0: 1.0},
                             logprobs=MAX_LOGPROBS)] * rows
    batch = SamplingBatch.build(params, [0] * rows, vocab, runner.device, random.Random(0), penalties=penalties)
    tokens = sample(logits, batch, torch.Generator(device=runner.device).manual_seed(0))  # the job's RNG untouched
    sampled_token_logprobs(logits, tokens, *logprob_rows(batch.num_logprobs))


@torch.inference_mode()
def profile_run(runner: Runner, worst_case: bool = False) -> None:
    step, blocks = largest_prefill(runner)
    layer = runner.attn_layers[0]
    # Attention must read real blocks; every sequence and layer shares one scratch cache (in the real
    # cache's page layouts, so the kernel variants are the job's).
    _, (dummy,) = allocate_kv_cache(1, blocks, runner.block_size, layer.num_kv_heads, layer.head_dim, kv_dtype(runner),
                                    runner.device, runner.config.kv_cache_scale)
    for attn in runner.attn_layers:
        attn.kv = dummy
    run_largest_prefill(runner, step, worst_case)


def recache_prefill_activations(runner: Runner) -> None:
    """Put a largest prompt step's activations back into PyTorch's caching allocator.

    Every CUDA-graph capture empties that cache (torch.cuda.graph does), so the profile run's blocks are gone
    by the time a job starts, and its first long prompt steps would cudaMalloc their activations mid-run
    (the benchmark's first run on the H100 grew 4-7 segments of 32-192 MiB; benchmarks/RESULTS.md, session
    15). Near the memory limit a cudaMalloc that fails makes the allocator free its cache and synchronize
    the device. The KV cache was sized to leave this peak free. The step reads the first blocks of the real
    cache and writes none."""
    step, blocks = largest_prefill(runner)
    if blocks <= runner.num_kvcache_blocks:
        run_largest_prefill(runner, step)
