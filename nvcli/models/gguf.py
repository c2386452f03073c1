"""GGUF files -> a Hugging Face layout directory, converted once and cached.

The engine only loads Hugging Face layout directories (config.json, safetensors, tokenizer files,
generation_config.json). A GGUF file (llama.cpp's format) is converted into one such directory on
first use and the directory is reused afterwards:

    convert_gguf_to_hf_dir("SmolLM2-135M-Instruct.Q4_1.gguf")
      -> ~/.cache/nv/gguf/<xxh64 of the file>-float32-v1/

What the conversion does:
- config.json from the GGUF metadata (`{arch}.block_count`, `embedding_length`, ...) through
  transformers' own config class, so it loads like any checkpoint's config;
- every tensor dequantized with the `gguf` package (the same code transformers uses) to float32
  (default: exact for every quant type, since dequantized values are float32 numbers) or
  bfloat16, renamed to Hugging Face names, with llama.cpp's rotary permutation of the Llama
  q/k rows undone (Qwen2/Qwen3 GGUFs are not permuted);
- the tokenizer rebuilt from the vocabulary, merges and token types in the metadata, with the
  pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`, and the chat template; saved with
  `save_pretrained`;
- generation_config.json with the BOS/EOS ids (EOT/EOM ids too, as extra EOS ids).

The cache key is the xxhash64 of the whole file (a copy or rename of the file hits the cache),
with a stat-keyed shortcut so a second start does not even re-read the file. The directory is
written under a temporary name and renamed into place, so a killed conversion never leaves a
directory that looks complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nvcli.models.gguf_reader import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from nvcli.models.gguf_reader import SUPPORTED_QUANT_TYPES as SUPPORTED_QUANT_TYPES
from nvcli.models.gguf_reader import GGUFError as GGUFError
from nvcli.models.gguf_reader import _f32, _field, check_supported
from nvcli.models.gguf_reader import open_gguf as open_gguf
from nvcli.models.gguf_tokenizer import SUPPORTED_PRE_TOKENIZERS as SUPPORTED_PRE_TOKENIZERS
from nvcli.models.gguf_tokenizer import build_tokenizer as build_tokenizer

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1
MARKER = "nv_gguf.json"
SHARD_BYTES = 4 << 30  # safetensors shard size for large models

STORE_DTYPES = ("float32", "bfloat16")

# GGUF per-layer tensor name -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")

class CacheDirError(GGUFError):
    """nv's cache directory cannot be created or written, so a GGUF file cannot be converted into it."""


# --------------------------------------------------------------------------------------------
# cache


def nv_cache_dir() -> Path:
    """nv's cache root (nvcli/env.py)."""
    from nvcli import env

    return env.settings().cache_dir


def file_digest(path: Path) -> str:
    """xxhash64 of the whole file, hex."""
    import xxhash

    h = xxhash.xxh64()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _cached_digest(path: Path, root: Path) -> str:
    """file_digest, remembered per (real path, size, mtime, inode) so a second start is instant."""
    import xxhash

    st = path.stat()
    stat_key = xxhash.xxh64(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}".encode()).hexdigest()
    memo = root / ".stat" / stat_key
    try:
        digest = memo.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{16}", digest):
            return digest
    except OSError:
        pass
    digest = file_digest(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{stat_key}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:  # a read-only cache still works, just slower
        pass
    return digest


def _remove_stale_temps(root: Path) -> None:
    """Remove temporary dirs of conversions whose process is gone (killed mid-conversion)."""
    for tmp in root.glob(".tmp-*"):
        m = re.match(r"\.tmp-.*-pid(\d+)-", tmp.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def convert_gguf_to_hf_dir(path: str | Path, cache_dir: Path | None = None, dtype: str = "float32") -> Path:
    """Return a Hugging Face layout directory holding the GGUF model at `path`.

    The directory is `<cache_dir>/gguf/<xxh64>-<dtype>-v<N>/` (cache_dir defaults to
    nv_cache_dir()); it is built on the first call and found in the cache afterwards.
    Tensors are stored in `dtype` ("float32", the default, or "bfloat16").
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if dtype not in STORE_DTYPES:
        raise ValueError(f"dtype must be one of {STORE_DTYPES}, got {dtype!r}")
    root = Path(cache_dir if cache_dir is not None else nv_cache_dir()).expanduser() / "gguf"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cache_dir_error(root, e) from None
    digest = _cached_digest(path, root)
    final = root / f"{digest}-{dtype}-v{CONVERTER_VERSION}"
    if (final / MARKER).is_file():
        return final

    _remove_stale_temps(root)
    t0 = time.perf_counter()
    log.info("converting %s to a Hugging Face directory in %s (first use only)", path, final)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest}-pid{os.getpid()}-", dir=root))
    except OSError as e:
        raise _cache_dir_error(root, e) from None
    try:
        info = _convert(path, tmp, dtype)
        info.update(source=str(path.resolve()), size=path.stat().st_size, xxh64=digest, dtype=dtype,
                    converter_version=CONVERTER_VERSION, seconds=round(time.perf_counter() - t0, 2))
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MARKER).is_file():  # not a lost race with another converter
                if final.exists():  # a leftover without a marker (never renamed complete): replace
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(tmp, final)
                else:
                    raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", path.name, time.perf_counter() - t0)
    return final


def _cache_dir_error(root: Path, e: OSError) -> CacheDirError:
    why = e.strerror or type(e).__name__
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(root) else ""
    return CacheDirError(f"nv's cache directory {root} cannot be used ({why}{where}); GGUF files are converted "
                         "into it. The cache is $NV_CACHE_DIR, else $XDG_CACHE_HOME/nv, else ~/.cache/nv: point "
                         "NV_CACHE_DIR at a writable directory")


# --------------------------------------------------------------------------------------------
# metadata


def gguf_hf_config(reader: Any) -> dict[str, Any]:
    """The Hugging Face config.json fields for a GGUF file's metadata."""
    arch = check_supported(reader)
    model_type, hf_arch = SUPPORTED_ARCHITECTURES[arch]

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise GGUFError(f"per-layer head_count_kv {sorted(set(kv_heads))} is not supported")
        kv_heads = kv_heads[0]
    head_dim = meta("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta("rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // heads
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are (cols, rows)

    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta("context_length", 4096)),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "dtype": "float32",
    }
    theta = meta("rope.freq_base")
    if theta is not None:
        cfg["rope_theta"] = _f32(theta)
    elif arch == "llama":
        cfg["rope_theta"] = 10000.0
    if arch == "qwen2" and head_dim == hidden // heads:
        del cfg["head_dim"]  # Qwen2's config has no head_dim field
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        cfg["mlp_bias"] = False
    rope_scaling = _rope_scaling(reader, arch, cfg, tensors)
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[hf_key] = int(value)
    return cfg


def _rope_scaling(reader: Any, arch: str, cfg: dict[str, Any], tensors: dict[str, Any]) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind is None and _field(reader, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", _field(reader, f"{arch}.rope.scale_linear")
    if kind == "linear" and factor is not None and float(factor) != 1.0:
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        return out
    if kind not in (None, "none", "linear"):
        raise GGUFError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear, yarn, "
                        "llama3 via rope_freqs.weight)")
    if "rope_freqs.weight" in tensors:
        from gguf.quants import dequantize

        t = tensors["rope_freqs.weight"]
        freqs = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        return llama3_rope_from_factors(freqs, cfg["rope_theta"], cfg["head_dim"])
    return None


def llama3_rope_factors(base: float, dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for Llama 3 rope scaling (convert_hf_to_gguf's formula)."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama3_rope_from_factors(freqs: np.ndarray, base: float, dim: int) -> dict | None:
    """Recover the Llama 3 rope_scaling dict from llama.cpp's rope_freqs.weight factors."""
    if np.allclose(freqs, 1.0):
        return None
    factor = float(freqs.max())
    # (orig, low, high) and (k*orig, k*low, k*high) give the same factors: prefer low = 1 (every
    # Llama 3.x release), then the usual high = 4 and original length 8192.
    origs = [8192] + [2 ** k for k in range(7, 21) if k != 13] + [3000, 6000, 12000, 24000]
    for low in (1.0, 0.5, 2.0):
        for high in (4.0, 2.0, 8.0, 16.0, 32.0):
            if high <= low:
                continue
            for orig in origs:
                cand = llama3_rope_factors(base, dim, factor, low, high, orig)
                if cand.shape == freqs.shape and np.allclose(cand, freqs, rtol=1e-5, atol=1e-6):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise GGUFError("GGUF rope_freqs.weight does not match Llama 3 rope scaling for any usual parameters; "
                    "this rope scaling is not supported")


# --------------------------------------------------------------------------------------------
# tensors


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor; None for tensors that become config (rope_freqs)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in nv's converter")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute` of Llama q/k rows (interleaved -> half-split rotary).

    llama.cpp stores rows as reshape(n_head, 2, d/2).swapaxes(1, 2); this is its inverse.
    `n_head` is the number of heads of this projection (KV heads for k).
    """
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def permute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permutation of Llama q/k rows (for tests and round trips)."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iter_hf_tensors(reader: Any, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for every weight of the GGUF file, one at a time."""
    from gguf.quants import dequantize

    llama = cfg["model_type"] == "llama"
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
        if llama and (".q_proj." in name or ".k_proj." in name):
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            w = unpermute_llama_qk(w, heads)
        yield name, w


def _write_safetensors(reader: Any, cfg: dict[str, Any], out: Path, dtype: str) -> int:
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    elem = torch.empty((), dtype=torch_dtype).element_size()
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0
    tmp_names: list[str] = []

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f"shard-{len(tmp_names):05d}.tmp"
            save_file(current, str(out / name), metadata={"format": "pt"})
            tmp_names.append(name)
            shards.append(list(current))
        current, size = {}, 0

    for name, w in iter_hf_tensors(reader, cfg):
        if not (w.flags.owndata and w.flags.writeable and w.flags.c_contiguous):
            w = np.array(w, dtype=np.float32, order="C")  # F32 tensors are views of the file
        tensor = torch.from_numpy(w).to(torch_dtype)
        nbytes = tensor.numel() * elem
        if current and size + nbytes > SHARD_BYTES:
            flush()
        current[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    if len(tmp_names) == 1:
        os.rename(out / tmp_names[0], out / "model.safetensors")
        return total
    weight_map = {}
    for i, (tmp_name, names) in enumerate(zip(tmp_names, shards, strict=True)):
        final = f"model-{i + 1:05d}-of-{len(tmp_names):05d}.safetensors"
        os.rename(out / tmp_name, out / final)
        weight_map.update({k: final for k in names})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return total


# --------------------------------------------------------------------------------------------
# tokenizer


def _generation_config(reader: Any) -> dict[str, Any]:
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    gen: dict[str, Any] = {}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    if ids:
        gen["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    return gen


def _convert(path: Path, out: Path, dtype: str) -> dict[str, Any]:
    from transformers import AutoConfig

    reader = open_gguf(path)
    cfg = gguf_hf_config(reader)  # raises GGUFError before any heavy work
    cfg["dtype"] = dtype
    tokenizer = build_tokenizer(reader, cfg["max_position_embeddings"])

    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gen = _generation_config(reader)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    total = _write_safetensors(reader, {**cfg, "model_type": model_type}, out, dtype)
    return {"gguf_architecture": _field(reader, "general.architecture"), "name": _field(reader, "general.name"),
            "file_type": _field(reader, "general.file_type"), "bytes": total}
