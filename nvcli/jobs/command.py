"""`nv generate` end to end: check the arguments, load the engine, run the job, report.

cli.py only declares the flags; this module does the work so it can be called and tested
without Typer. `generate(args)` returns the process exit code:
0 every line succeeded · 1 some lines failed · 2 usage error · 130 Ctrl-C · 141 output closed.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from nvcli import env
from nvcli.config import ConfigError, EngineConfig
from nvcli.engine.protocol import Engine
from nvcli.jobs import jsonio
from nvcli.jobs.format_pool import default_workers
from nvcli.jobs.reader import iter_fd_lines
from nvcli.jobs.requests import Defaults
from nvcli.jobs.resume import ResumeError, scan_output
from nvcli.jobs.runner import (
    EXIT_INTERRUPTED,
    EXIT_LINE_ERRORS,
    EXIT_USAGE,
    JobOptions,
    JobResult,
    LineCounter,
    run_job,
)
from nvcli.jobs.shards import Shard, ShardError
from nvcli.jobs.tool_calls import PARSER_CHOICES
from nvcli.jobs.writer import OutputWriteError
from nvcli.sampling_params import SamplingParams, StructuredOutputsParams


class UsageError(Exception):
    """Bad arguments: printed as `nv: error: ...`, exit code 2."""


@dataclass
class GenerateArgs:
    input: str
    output: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig keyword arguments (model included)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams defaults set by flags
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_ids: bool = False
    unordered: bool = False
    resume: bool = False
    retry_errors: bool = False  # with resume: error lines are served again
    num_shards: int | None = None  # --num-shards K with --shard-index I: serve the lines p with p % K == I (shards.py)
    shard_index: int | None = None
    quiet: bool = False
    max_in_flight: int | None = None
    format_workers: int | None = None  # None: format_pool.default_workers()
    json_schema: str | None = None  # a JSON schema file: the output constraint of lines that set none
    tool_call_parser: str = "auto"  # how tool_choice "auto" finds tool calls in the text (tool_calls.PARSER_CHOICES)
    debug: bool = False  # print the resolved settings; an engine failure shows its traceback


def _device(engine: Engine) -> str:
    return engine.config.resolved_device()


# The model's generation_config.json may recommend these (vLLM's `--generation-config auto`).
GEN_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def err(msg: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"nv: {msg}\n")
        sys.stderr.flush()


def generate(args: GenerateArgs) -> int:
    try:
        return _generate(args)
    except UsageError as e:
        err(f"error: {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C before the job loop took over (e.g. while loading the model)
        err("interrupted")
        return EXIT_INTERRUPTED


def _generate(args: GenerateArgs) -> int:
    # 1. cheap checks first: nothing slow happens before the arguments are known to be good
    src_path = _check_input(args.input)
    out_path = None if args.output in (None, "-") else Path(args.output)
    if src_path is None and sys.stdin is None:
        raise UsageError("the input is - but stdin is closed: give an input file")
    if out_path is None and sys.stdout is None:
        raise UsageError("stdout is closed: write the output to a file with -o OUTPUT")
    if args.resume and out_path is None:
        raise UsageError("--resume needs an output file (-o OUTPUT): it reads that file to skip answered lines")
    if args.retry_errors and not args.resume:
        raise UsageError("--retry-errors goes with --resume: it serves again the lines whose answers in OUTPUT are errors")
    try:
        shard = Shard.from_flags(args.num_shards, args.shard_index)
    except ShardError as e:
        raise UsageError(str(e)) from None
    if out_path is not None:
        if out_path.is_dir():
            raise UsageError(f"output {str(out_path)!r} is a directory")
        if not out_path.parent.exists():
            raise UsageError(f"cannot write {str(out_path)!r}: directory {str(out_path.parent)!r} does not exist")
        if src_path is not None and out_path.exists() and out_path.resolve() == src_path.resolve():
            raise UsageError("the output file is the input file; write to another file")
    try:
        SamplingParams(**args.sampling)
    except ValueError as e:
        name, _, why = str(e).removeprefix("SamplingParams.").partition(":")
        raise UsageError(f"--{name.replace('_', '-')}:{why}") from None
    try:
        EngineConfig(**args.engine)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if args.tool_call_parser not in PARSER_CHOICES:
        raise UsageError(f"--tool-call-parser: must be one of {', '.join(PARSER_CHOICES)} "
                         f"(got {args.tool_call_parser!r})")
    structured_outputs = _json_schema(args.json_schema)
    done: dict[str, bool] = {}
    if args.resume and out_path is not None:
        try:
            state = scan_output(out_path, retry_errors=args.retry_errors)
        except (ResumeError, OSError) as e:
            raise UsageError(str(e)) from None
        done = state.done
        if not args.quiet:
            note = f"--resume: {state.lines} lines already in {str(out_path)!r}"
            if state.repaired_bytes:
                note += f"; cut a torn last line ({state.repaired_bytes} bytes) left by an interrupted run"
            if state.retried:
                note += f"; took out {state.retried} error lines to serve them again"
            elif state.num_errors:
                note += f", {state.num_errors} of them errors (--retry-errors serves those lines again)"
            err(note)
    if out_path is not None and not os.access(out_path if out_path.exists() else out_path.parent, os.W_OK):
        raise UsageError(f"cannot write {str(out_path)!r}: permission denied")

    # 2. the engine
    engine, model_name = _load_engine(args)
    try:
        keep = args.sampling.get("truncate_prompt_tokens")
        if keep is not None and keep >= engine.max_model_len:  # else every line would get the same error line
            raise UsageError(f"--truncate-prompt-tokens: must be below --max-model-len={engine.max_model_len} "
                             f"(got {keep}; -1 keeps as many tokens as fit)")
        most = args.sampling.get("max_tokens")
        if most is not None and most >= engine.max_model_len:  # no prompt would leave room: every line an error
            raise UsageError(f"--max-tokens: must be below --max-model-len={engine.max_model_len} (got {most}): a "
                             "prompt and its completion share the context")
        defaults = Defaults(
            sampling=_sampling_defaults(engine, args),
            chat_template_kwargs=dict(args.chat_template_kwargs),
            return_token_ids=args.return_token_ids,
            structured_outputs=structured_outputs,
            tool_call_parser=args.tool_call_parser,
        )
        max_num_seqs = int(args.engine.get("max_num_seqs") or EngineConfig.__dataclass_fields__["max_num_seqs"].default)
        opts = JobOptions(
            warn=err if args.quiet else None,
            defaults=defaults,
            ordered=not args.unordered,
            max_in_flight=args.max_in_flight or max(64, 4 * max_num_seqs) * engine.config.data_parallel_size,
            model_name=model_name,
            done=done,
            format_workers=default_workers(_device(engine)) if args.format_workers is None else args.format_workers,
            shard=shard,
        )
        return _run(engine, args, opts, src_path, out_path)
    finally:
        with contextlib.suppress(Exception):
            engine.shutdown()


def _check_input(spec: str) -> Path | None:
    if spec == "-":
        return None
    p = Path(spec)
    if not p.exists():
        raise UsageError(f"input file {spec!r} does not exist (use - to read stdin)")
    if p.is_dir():
        raise UsageError(f"input {spec!r} is a directory, not a JSONL file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"input file {spec!r} is not readable")
    return p


def _json_schema(path: str | None) -> StructuredOutputsParams | None:
    """--json-schema: the file's schema as every line's default constraint, checked before the model loads (llguidance
    compiles a schema without a tokenizer), so a bad one stops the job at start-up, not on every line."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"--json-schema: file {path!r} does not exist") from None
    except OSError as e:
        raise UsageError(f"--json-schema: cannot read {path!r}: {e.strerror or e}") from None
    try:
        schema = jsonio.loads(data.removeprefix(b"\xef\xbb\xbf"))
    except (jsonio.JSONDecodeError, ValueError) as e:
        where = f" at line {e.lineno} column {e.colno}" if getattr(e, "colno", None) else ""
        raise UsageError(f"--json-schema: {path!r} is not valid JSON: {getattr(e, 'msg', None) or e}{where}") from None
    if not isinstance(schema, dict):
        kind = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(schema), "a number")
        raise UsageError(f"--json-schema: {path!r} must hold a JSON schema (an object), got {kind}")
    problem = _schema_problem(schema)
    if problem:
        raise UsageError(f"--json-schema: {path!r} is not a JSON schema nv can use: {problem}")
    return StructuredOutputsParams(json=schema)


def _schema_problem(schema: dict) -> str | None:
    """What llguidance finds wrong with a JSON schema (an unknown type, a $ref to nowhere), or None."""
    from nvcli.engine.structured_output import constraint_problem

    try:
        return constraint_problem(StructuredOutputsParams(json=schema))
    except ImportError:  # llguidance missing: the engine reports it with the first request
        return None


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors that mean "change your command line": printed without a traceback, exit code 2."""
    types: list[type[BaseException]] = [ConfigError]
    for module, names in (("nvcli.models.resolve", ("ModelNotFoundError", "UnsafeCheckpointError")),
                          ("nvcli.models.gguf", ("GGUFError",))):
        try:
            mod = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        types.extend(t for t in (getattr(mod, n, None) for n in names) if isinstance(t, type))
    return tuple(types)


def make_engine(config: EngineConfig) -> Engine:
    """Build the engine (tests replace this with a fake)."""
    from nvcli.engine import build_engine

    return build_engine(config)


def _load_engine(args: GenerateArgs) -> tuple[Engine, str]:
    model = args.engine.get("model")
    if not args.quiet:
        err(f"loading model {model or '(default)'} ...")
    try:
        engine = make_engine(EngineConfig(**args.engine))
    except _user_error_types() as e:
        raise UsageError(str(e)) from None
    if args.debug:
        err(env.report(engine.config))
    return engine, model or _default_model_name(engine)


def _default_model_name(engine: Engine) -> str:
    try:
        from nvcli.models.resolve import DEFAULT_MODEL_FILE

        return str(DEFAULT_MODEL_FILE).removesuffix(".gguf")
    except ImportError:
        return Path(str(engine.model_dir or "model")).name


def _sampling_defaults(engine: Engine, args: GenerateArgs) -> dict[str, Any]:
    """Command-line flags, on top of the model's own recommendations (generation_config.json)."""
    sampling = dict(args.sampling)
    recommended = {k: v for k, v in _generation_config(engine).items() if k not in sampling}
    if recommended:
        try:
            SamplingParams(**{**recommended, **sampling})
        except ValueError:
            return sampling
        sampling = {**recommended, **sampling}
        if not args.quiet:
            shown = " ".join(f"{k}={v}" for k, v in recommended.items())
            err(f"sampling defaults from the model's generation_config.json: {shown} (flags override)")
    return sampling


def _generation_config(engine: Engine) -> dict[str, Any]:
    candidates = [engine.model_dir, engine.config.model, getattr(engine.tokenizer, "name_or_path", None)]
    for c in candidates:
        if not c:
            continue
        f = Path(str(c)) / "generation_config.json"
        if f.is_file():
            try:
                cfg = jsonio.loads(f.read_bytes())
            except (OSError, ValueError):
                return {}
            if not isinstance(cfg, dict) or cfg.get("do_sample") is False:
                return {}
            return {k: cfg[k] for k in GEN_CONFIG_FIELDS if isinstance(cfg.get(k), (int, float))}
    return {}


def _run(engine: Engine, args: GenerateArgs, opts: JobOptions, src_path: Path | None, out_path: Path | None) -> int:
    from nvcli.dashboard import LiveDashboard, PlainProgress

    counter = None
    if src_path is not None and stat.S_ISREG(src_path.stat().st_mode):
        counter = LineCounter(src_path, opts.shard)
        counter.start()
    reporter: LiveDashboard | PlainProgress | None = None
    if not args.quiet:
        from rich.console import Console

        console = Console(stderr=True)
        # A live view needs a terminal to itself: not when the JSONL also goes to that terminal.
        stdout_tty = out_path is None and _isatty(sys.stdout)
        reporter = LiveDashboard(console) if console.is_terminal and not stdout_tty else PlainProgress(sys.stderr)
        reporter.start(f"generating with {opts.model_name}")
    src: Iterable[bytes] = open(src_path, "rb") if src_path is not None else _stdin_lines()  # noqa: SIM115
    dst: BinaryIO = open(out_path, "ab" if args.resume else "wb") if out_path is not None else sys.stdout.buffer  # noqa: SIM115
    result: JobResult | None = None
    try:
        result = run_job(engine, src, dst, opts, reporter, counter)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OutputWriteError as e:  # a full disk, /dev/full: the job cannot go on
        if reporter is not None:
            reporter.stop()
        where = repr(str(out_path)) if out_path is not None else "stdout"
        err(f"error: the job stopped: cannot write to {where}: {e.strerror}{_resume_hint(out_path)}")
        return EXIT_LINE_ERRORS
    except Exception as e:  # the engine died mid-job (a lost TP worker, out of memory, a bug)
        if reporter is not None:
            reporter.stop()
        if args.debug or env.settings().debug:
            raise
        where = _resume_hint(out_path)
        err(f"error: the job stopped: {type(e).__name__}: {e}{where} ({env.DEBUG}=1 shows the traceback)")
        return EXIT_LINE_ERRORS
    finally:
        if reporter is not None:
            reporter.stop()
        if isinstance(src, io.IOBase):
            src.close()
        if out_path is not None:
            with contextlib.suppress(OSError):
                dst.close()
    if result.output_closed:  # `nv generate ... | head -1`: not an error worth a word
        _silence_stdout()
        return result.exit_code
    if reporter is not None:
        reporter.summary(result)
    elif result.failed or result.counts.skipped_errors:
        n = result.failed + result.counts.skipped_errors
        err("1 line failed (its output line carries an error)" if n == 1
            else f"{n} lines failed (their output lines carry an error)")
    return result.exit_code


def _resume_hint(out_path: Path | None) -> str:
    """Where the finished lines are and how to go on, for a job that stopped early: only an output file that
    --resume can read again (not stdout, /dev/full or a pipe)."""
    if out_path is None or not out_path.is_file():
        return ""
    return f"; the finished lines are in {str(out_path)!r}: rerun with --resume to continue"


def _stdin_lines() -> Iterable[bytes]:
    try:
        return iter_fd_lines(sys.stdin.fileno())
    except (AttributeError, ValueError, OSError):  # not a real file (e.g. under a test runner)
        return sys.stdin.buffer


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _silence_stdout() -> None:
    """The reader of stdout is gone: point fd 1 at /dev/null so exit-time flushes stay quiet."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
