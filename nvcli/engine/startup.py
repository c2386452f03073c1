"""Start-up: the model's weights, compile-ahead of its Triton kernels and their warm-up.

A first start-up on a machine compiles every Triton variant the job will launch side by side, in worker processes
(kernels/compile_ahead.py), from a dry pass over two decoder layers that runs the start-up's own forwards: the
profile run, every CUDA graph's step, the warm-up shapes. A marker keyed by the settings and the model's shapes
tells a later start-up that the disk cache holds them all. Warm-up then runs the shapes a job would otherwise compile
mid-run (odd prompt lengths, the LM head and sampler at a few rows, eager steps over long tables)."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nvcli import env
from nvcli.config import ConfigError, EngineConfig
from nvcli.engine import kv_sizing
from nvcli.engine.penalties import PenaltyBatch, apply_penalties
from nvcli.engine.sampler import SamplingBatch, sample, token_logprobs
from nvcli.engine.step_input import StepInput
from nvcli.engine.structured_output import mask_words
from nvcli.models.loader import iter_safetensors, load_dummy_weights, load_weights
from nvcli.models.registry import model_class
from nvcli.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nvcli.kernels.compile_ahead import CompileWorkers, StartupMarker
    from nvcli.kernels.kv_layout import PagedKV
    from nvcli.models.model_config import ModelConfig

log = logging.getLogger("nvcli")
TORCH_DTYPES = kv_sizing.TORCH_DTYPES


def pick_dtype(config: EngineConfig, device: str) -> torch.dtype:
    if config.dtype != "auto":
        dtype = TORCH_DTYPES[config.dtype]
    elif device == "cpu":
        dtype = torch.float32
    else:
        dtype = torch.bfloat16
    if device == "cpu" and dtype != torch.float32:
        log.warning("dtype %s on CPU is slow; float32 is the CPU default", dtype)
    return dtype


def compile_plan(config: EngineConfig, model_config: ModelConfig, rank: int, device: torch.device,
                 workers: CompileWorkers | None) -> tuple[StartupMarker | None, CompileWorkers | None]:
    """(the marker to write once this start-up has compiled ahead, or None where it need not; its compile workers).
    A start-up like an earlier one (its marker exists) finds every Triton variant in the disk cache; otherwise the
    compile workers start now unless the caller started them, so that their imports overlap the weights' load."""
    marker = startup_marker(config, model_config, rank, device) if device.type == "cuda" else None
    if marker is not None and marker.exists():
        marker = None
    if marker is not None and workers is None:
        workers = _start_compile_workers(config, device)
    elif marker is None and workers is not None:
        workers.shutdown()
        workers = None
    return marker, workers


def load_model(config: EngineConfig, model_config: ModelConfig, model_dir: Path, device: torch.device,
               dtype: torch.dtype) -> torch.nn.Module:
    """The model on `device` in `dtype`, its weights loaded (or random: load_format dummy) and its norms folded.
    FP8 projections and experts (an FP8 checkpoint, or --quantization fp8) stay FP8 on a GPU with FP8 tensor cores,
    else are dequantized to `dtype` before the norms fold into them (models/layers/fp8.py, moe_fp8.py)."""
    from nvcli.kernels.block_fp8 import fp8_gemm_supported
    from nvcli.models.layers.fp8 import finish_fp8_layers, fp8_projections, fp8_spec
    from nvcli.models.layers.moe_fp8 import finish_fp8_experts

    fp8 = fp8_spec(config.quantization, model_config.quantization, device, dtype, config.tensor_parallel_size)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), fp8_projections(fp8):
            model = model_class(model_config)(model_config)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.load_format == "dummy":
        load_dummy_weights(model, config.seed)
    else:
        load_weights(model, iter_safetensors(model_dir))
    if fp8 is not None:
        keep = fp8_gemm_supported(device)
        if keep and config.batch_invariant:
            raise ConfigError("--batch-invariant: not with FP8 weights on this GPU yet (the FP8 GEMM has no "
                              "batch-invariant form); leave out --quantization fp8 or use a bf16 checkpoint")
        layers = finish_fp8_layers(model, keep, dtype)
        experts = finish_fp8_experts(model, keep, dtype)
        log.info("%d projections and %d expert blocks in FP8: %s", layers, experts,
                 "FP8 GEMM" if keep else f"dequantized to {dtype} at load")
    model.fold_norm_weights()  # deferred RMSNorm (models/llama.py)
    model.set_batch_invariant(config.batch_invariant)
    return model.eval()


# The compile-ahead dry pass runs this many decoder layers: every later one launches the kernel variants the second
# one does (the same module at the same shapes; the first differs, with no residual stream yet), so the pass records
# the same variants in a fraction of its Python (28 layers: 3.2-5.7 s on the H100 host).
DRY_PASS_LAYERS = 2


@contextmanager
def first_decoder_layers(model: torch.nn.Module, n: int) -> Iterator[None]:
    """Within: `model` runs only its first `n` decoder layers (`model.model.layers`; a model without that list, or
    with no more than n, runs whole)."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) <= n:
        yield
        return
    decoder.layers = torch.nn.ModuleList(list(layers)[:n])
    try:
        yield
    finally:
        decoder.layers = layers


def startup_marker(config: EngineConfig, model_config: ModelConfig, rank: int, device: torch.device) -> StartupMarker:
    """A start-up's compile-ahead marker: keyed by what shapes its launches (where the model lives, its tokenizer
    and the seed shape none)."""
    from nvcli.kernels.compile_ahead import StartupMarker

    skip = ("model", "tokenizer", "seed")
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in skip}
    shapes = model_config.to_dict()
    major, minor = torch.cuda.get_device_capability(device)
    return StartupMarker([settings, shapes, rank], f"{torch.cuda.get_device_name(device)} sm_{major}{minor}")


def start_compile_workers_if_cold(config: EngineConfig, model_config: ModelConfig, rank: int = 0) -> CompileWorkers | None:
    """The compile workers of a start-up that will compile ahead (on a GPU, where no earlier start-up of the same key left its marker), started now; else None. Each worker warms up for the GPU
    as it starts (compile_ahead._warm_worker). The engine calls this before loading the tokenizer, so that the
    workers' imports and warm-up (3-5 s on the H100 host) overlap it instead of the dry pass."""
    if config.resolved_device() != "cuda":
        return None
    device = torch.device("cuda", rank)
    if startup_marker(config, model_config, rank, device).exists():
        return None
    return _start_compile_workers(config, device)


def _start_compile_workers(config: EngineConfig, device: torch.device) -> CompileWorkers | None:
    """Compile workers for `device`'s start-up, started now (None where this process may have no children); the
    caller has checked that the start-up compiles ahead."""
    from triton.runtime.driver import driver

    from nvcli.kernels.compile_ahead import start_compile_workers

    torch.cuda.set_device(device)
    target = driver.active.get_current_target()
    # NV_COMPILE_WORKERS sets the count; else one per core this rank's share of the cores holds, at most 16
    num_workers = env.settings().compile_workers or min(16, (os.cpu_count() or 1) // config.tensor_parallel_size)
    return start_compile_workers(max(1, num_workers),
                                 (target.backend, target.arch, target.warp_size))


@torch.inference_mode()
def compile_ahead(runner: kv_sizing.Runner, workers: CompileWorkers | None) -> tuple[int, float]:
    """Compile, in parallel, every Triton variant the start-up's forwards below will launch (see
    kernels/compile_ahead.py): the profile run, every graph's step, the warm-up shapes. -> (variants, dry-pass s)"""
    from nvcli.kernels.compile_ahead import compile_ahead as compile_variants

    def forwards() -> None:
        kv_sizing.profile_run(runner)  # leaves its scratch cache on the layers: the steps below read block 0 of it
        graphs = runner.cuda_graphs
        if graphs is not None:
            graphs.make_inputs()
            for key in graphs.keys() + graphs.shared_keys():  # shared variants are captured when a job needs one
                graphs.forward(key)
        warm_up_kernels(runner, dry_run=True)

    with first_decoder_layers(runner.model, DRY_PASS_LAYERS):
        result = compile_variants(forwards, runner.device, workers=workers)
    for attn in runner.attn_layers:
        attn.kv = None  # the scratch cache goes; kv_sizing.allocate binds the job's
    torch.cuda.empty_cache()
    return result


def _warm_up_tables(block_size: int, max_table_width: int) -> tuple[list[list[int]], list[list[int]]]:
    """The block tables warm-up steps read: a short one (32 tokens' blocks), and as wide a one as max_model_len allows
    (block 0 over and over; the lengths stay short, so only the first tokens are read): decode attention splits the
    KV as it does for long sequences, which is its other variant (the split-KV merge). Without it a job's first long
    eager step compiled that variant mid-run."""
    return [list(range(-(-32 // block_size)))], [[0] * max_table_width]


@torch.inference_mode()
def warm_up_forwards(forward: Callable[[StepInput], object], kv: PagedKV | None, block_size: int,
                     max_table_width: int, max_model_len: int | None) -> bool:
    """The prompt and eager-step shapes of warm_up_kernels through `forward` (a runner's, or a draft model's eager
    forward): prefill of odd and multiple-of-16 token counts, one-token rows, and one-token rows beside a prompt
    chunk over short and long tables. Writes no KV (slot -1). False where the cache is too small to try them."""
    assert kv is not None, "warm-up reads the bound KV cache"
    if kv.num_blocks * block_size < 32 or (max_model_len or 32) < 32:
        return False  # the shapes below need 32 tokens of cache to read from
    blocks, wide = _warm_up_tables(block_size, max_table_width)
    # prefill: odd / multiple-of-16 token counts; eager decode; decode rows beside a prompt chunk (split
    # attention: the decode kernel at one and at 17 rows, over short and long tables) where a step too large for
    # the mixed graphs runs them; prompt rows of 40 and 65 tokens over the long table, because the prefill kernel's
    # query tile grows with the step's longest query up to 128 rows (kernels/prefill_attention.py): a draft model,
    # whose head grouping the target's profile run never compiled, would compile its long-query tiles at the first
    # sequence catching up, mid-run
    shapes = [([17, 14], blocks), ([16, 32], blocks), ([1], blocks), ([1, 16], blocks), ([1, 16], wide),
              ([1] * 17 + [14], blocks), ([1] * 17 + [14], wide)]
    if (max_model_len or 0) >= 65 and max_table_width * block_size >= 65:
        shapes += [([40, 3], wide), ([65, 14], wide)]
    for lens, table in shapes:
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        step = StepInput([0] * qsl[-1], [p for n in lens for p in range(n)], [-1] * qsl[-1], qsl, lens,
                         table * len(lens), False, num_decode_rows=lens.count(1) if len(lens) > 1 else 0)
        forward(step)
    return True


@torch.inference_mode()
def warm_up_kernels(runner: kv_sizing.Runner, dry_run: bool = False) -> None:
    """Compile, at start-up, the Triton variants a job would otherwise compile mid-run.

    Triton specializes integer arguments (== 1, multiples of 16) and our kernels pick configs by
    row count, so the first prefill of an odd length, or the LM head and sampler at 1, 2 or a few
    rows once a job's batch drains, each cost a compile (up to a second) in the middle of the
    job. Every step here writes nothing to the KV cache (slot -1) and its outputs are dropped.
    `dry_run` (the compile-ahead pass, whose kernels leave outputs unwritten): no sampling, and no
    eager decode steps where decode graphs are to be captured (the real pass replays those).
    """
    if not warm_up_forwards(runner.forward, runner.attn_layers[0].kv, runner.block_size, runner.max_table_width,
                            runner.config.max_model_len):
        return
    blocks, wide = _warm_up_tables(runner.block_size, runner.max_table_width)
    # imported here, not with this module: the CPU tests switch Triton to its interpreter after importing the engine
    from nvcli.kernels.skinny_gemm import MAX_M as SKINNY_MAX_M

    # LM head at every row count the skinny GEMM takes (its configs and row blocks change with the count and with
    # the model's shape: a tiny model's LM head compiled a variant mid-run when only 1, 2 and 3 rows were warmed)
    # and cuBLAS past them; eager decode steps (enforce_eager) over short and long tables, as above
    skinny_rows = [(rows, blocks) for rows in range(2, SKINNY_MAX_M + 1)]
    for rows, table in [(1, wide), *skinny_rows, (SKINNY_MAX_M + 1, blocks), (SKINNY_MAX_M + 1, wide)]:
        step = StepInput([0] * rows, [0] * rows, [-1] * rows, list(range(rows + 1)), [1] * rows,
                         table * rows, True)
        if dry_run and not runner.config.enforce_eager:
            hidden = torch.zeros(rows, runner.model_config.hidden_size, dtype=runner.dtype, device=runner.device)
            final = (hidden, hidden)
        else:
            final = runner.forward(step)
        if runner.rank == 0 and not dry_run:
            logits = runner.model.compute_logits(*final)
            for temperature in (0.0, 0.7):  # argmax, fused sampler
                params = [SamplingParams(temperature=temperature)] * rows
                sample(logits, SamplingBatch.build(params, [0] * rows, logits.shape[1], runner.device, random.Random(0)),
                       torch.Generator(device=runner.device).manual_seed(0))  # leaves the job's RNG alone
            if rows == 1:
                # a step with penalized rows samples from a float32 copy that the penalty kernel writes
                # (engine/penalties.py): that kernel, and the fused sampler's float32 variant for a bf16 / fp16
                # model, would otherwise compile at a job's first such step
                one = torch.zeros(1, dtype=torch.int64, device=runner.device)
                history = torch.zeros((1, logits.shape[1]), dtype=torch.int32, device=runner.device)
                neutral = torch.ones(1, dtype=torch.float32, device=runner.device)
                penalized = apply_penalties(logits, PenaltyBatch(rows=one, slots=one, presence=neutral,
                                                                 frequency=neutral, repetition=neutral,
                                                                 counts=history, seen=history.bool()))
                sample(penalized, SamplingBatch.build([SamplingParams(temperature=0.7)], [0], logits.shape[1],
                                                      runner.device, random.Random(0)),
                       torch.Generator(device=runner.device).manual_seed(0))
                # top-k / top-p / min-p (a model's generation_config often sets them for every request): the
                # floor kernel and the sampler's floored variants, on model-dtype and float32 logits
                filtered = [SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05)]
                for x in (logits, penalized):
                    sample(x, SamplingBatch.build(filtered, [0], logits.shape[1], runner.device, random.Random(0)),
                           torch.Generator(device=runner.device).manual_seed(0))
                from nvcli.kernels.token_bitmask import apply_token_bitmask_

                # structured outputs' mask (kernels/token_bitmask.py), on the model-dtype logits it writes in a job
                words = mask_words(logits.shape[1])
                apply_token_bitmask_(logits, one, torch.full((1, words), -1, dtype=torch.int32, device=runner.device))
        else:
            logits = runner.model.compute_logits(*final)
        if rows <= SKINNY_MAX_M:
            # a prompt step's few last rows under the deferred norm (no residual): the final RMSNorm alone, with
            # PDL at these row counts; a job whose first prompt step held one sequence compiled it mid-run
            runner.model.compute_logits(final[0], None)
        if runner.rank == 0 and rows == 1:  # logprobs and prompt_logprobs: each top-k width, in the dry pass too
            from nvcli.kernels.token_logprobs import TOP_WIDTHS

            one = torch.zeros(1, dtype=torch.int64, device=runner.device)
            for k in TOP_WIDTHS:
                token_logprobs([logits], one, min(k, logits.shape[1]), runner.device)
    torch.cuda.synchronize(runner.device)
