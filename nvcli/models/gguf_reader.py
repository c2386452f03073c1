"""Reading a GGUF file (llama.cpp's format): the `gguf` package's reader, its metadata fields, and the check that nv
converts what the file holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# GGUF `general.architecture` -> (transformers model_type, architectures entry)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# Quant types dequantized by the `gguf` package that we accept (names of GGMLQuantizationType).
SUPPORTED_QUANT_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


class GGUFError(ValueError):
    """A GGUF file nv cannot convert; the message says what is unsupported and what is."""


_READER_CLASS: Any = None


def open_gguf(path: str | Path) -> Any:
    """A gguf.GGUFReader over a plain ndarray view of the file's memory map.

    Same parsing code as gguf.GGUFReader; slicing an ndarray view instead of np.memmap skips
    memmap's per-slice bookkeeping, which makes reading the metadata about 2.5x faster.
    """
    global _READER_CLASS
    if _READER_CLASS is None:
        from gguf.gguf_reader import GGUFReader

        class _Reader(GGUFReader):
            @property
            def data(self) -> np.ndarray:
                return self._nv_data

            @data.setter
            def data(self, value: np.ndarray) -> None:
                self._nv_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        _READER_CLASS = _Reader
    try:
        return _READER_CLASS(str(path), "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError) as e:
        # the gguf package's parser on a file that is not GGUF ("GGUF magic invalid") or is cut short ("cannot
        # reshape array ..."): its own errors say nothing of the file
        raise GGUFError(f"{path}: not a valid GGUF file, or a truncated one ({e}); download or convert it "
                        "again") from None


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _tensor_type_name(tensor: Any) -> str:
    return tensor.tensor_type.name


def check_supported(reader: Any) -> str:
    """Raise GGUFError unless every tensor type and the architecture are supported; return the arch."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; nv converts {', '.join(SUPPORTED_ARCHITECTURES)} "
            "GGUF files (general.architecture)"
        )
    bad = [(t.name, _tensor_type_name(t)) for t in reader.tensors if _tensor_type_name(t) not in SUPPORTED_QUANT_TYPES]
    if bad:
        kinds = sorted({k for _, k in bad})
        examples = ", ".join(f"{n} ({k})" for n, k in bad[:3])
        raise GGUFError(
            f"GGUF quant type {', '.join(kinds)} is not supported (tensors {examples}"
            f"{', ...' if len(bad) > 3 else ''}); supported: {', '.join(SUPPORTED_QUANT_TYPES)}. "
            "Use a GGUF with one of those types, or the original safetensors checkpoint"
        )
    return arch
