"""A model's tokenizer: transformers' own class, loaded without `AutoTokenizer` where that gives the same one.

`AutoTokenizer`'s module imports transformers' modeling and generation packages on its way in (one of its
config imports runs `auto_docstring`): 2.5-3 s of every start-up on the H100 host (see model_config.py). For the
(model type, `tokenizer_class`) pairs in `DIRECT_CLASSES`, the class AutoTokenizer resolves to is imported
directly; `tests/models/test_tokenizer.py` checks, for each pair, that AutoTokenizer picks the same class and that
both encode, decode and render chat templates alike. Everything else (other pairs, remote code, a hub id, no
tokenizer.json) goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# (config.json model_type, tokenizer_config.json tokenizer_class) -> the class AutoTokenizer resolves it to
DIRECT_CLASSES: dict[tuple[str, str], str] = {
    ("qwen3", "Qwen2Tokenizer"): "Qwen2Tokenizer",
    ("qwen3_moe", "Qwen2Tokenizer"): "Qwen2Tokenizer",
    ("qwen2", "Qwen2Tokenizer"): "Qwen2Tokenizer",
    ("llama", "TokenizersBackend"): "TokenizersBackend",  # what nv writes for a converted GGUF (models/gguf.py)
    ("llama", "PreTrainedTokenizerFast"): "TokenizersBackend",  # Llama 3's checkpoints
}


def direct_class_name(path: Path) -> str | None:
    """The transformers class to load `path`'s tokenizer with directly, or None for AutoTokenizer. The model type
    is the directory's own config.json's, as AutoTokenizer reads it."""
    files = [path / "config.json", path / "tokenizer_config.json"]
    if not ((path / "tokenizer.json").is_file() and all(f.is_file() for f in files)):
        return None
    try:
        config, settings = (json.loads(f.read_text()) for f in files)
    except (OSError, ValueError):
        return None  # AutoTokenizer reports it
    if not (isinstance(config, dict) and isinstance(settings, dict)) or "auto_map" in settings:
        return None
    return DIRECT_CLASSES.get((config.get("model_type"), settings.get("tokenizer_class")))


_NO_LIMIT = int(1e30)  # transformers' own "no limit" (VERY_LARGE_INTEGER)


def load_tokenizer(name_or_path: str | Path) -> Any:
    """The tokenizer of a model directory (or of a tokenizer directory or hub id given with --tokenizer)."""
    path = Path(name_or_path)
    name = direct_class_name(path)
    if name is not None:
        import transformers

        tokenizer = getattr(transformers, name).from_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    # The engine checks every prompt against max_model_len and never truncates; the tokenizer's own limit only
    # printed transformers' "Token indices sequence length is longer than ..." warning, even under --quiet.
    tokenizer.model_max_length = _NO_LIMIT
    return tokenizer


# Texts whose tokens transformers' space clean-up changes when a tokenizer asks for it (" ." -> "."): probed below
_CLEAN_UP_PROBES = (" .", " ,", " !", " ?", " n't", " 'm", " 's", " 've", " 're")


def vocabulary_texts(tokenizer: Any) -> list[str]:
    """Every token id of `tokenizer` decoded on its own, as `tokenizer.decode([id], skip_special_tokens=False)` gives
    it. A fast tokenizer decodes them all in one call to its Rust backend (threaded; 0.25 s for Qwen3's 151,669 on
    the 2-core CPU machine, against 0.78 s through transformers' batch_decode, a Python loop over the ids). What
    transformers does after the backend (its space clean-up, which version 5 skips for BPE tokenizers) is not
    repeated here: a probe of ids, those clean-up would change among them, must decode alike both ways, else the
    vocabulary goes through batch_decode."""
    ids = [[i] for i in range(len(tokenizer))]
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch"):
        texts = backend.decode_batch(ids, skip_special_tokens=False)
        probe = {*range(0, len(ids), 997), *tokenizer.all_special_ids,
                 *(t for text in _CLEAN_UP_PROBES for t in tokenizer.encode(text, add_special_tokens=False)[:1])}
        if all(texts[i] == tokenizer.decode([i], skip_special_tokens=False) for i in probe if i < len(texts)):
            return texts
    return tokenizer.batch_decode(ids, skip_special_tokens=False)


def extend_vocabulary(texts: list[str], tokenizer: Any, max_id: int) -> list[str]:
    """`texts` (a vocabulary_texts list), extended in place to hold ids up to `max_id`: a model's vocabulary may be
    padded past its tokenizer's, and those ids decode on their own (to "", usually)."""
    texts.extend(tokenizer.decode([t], skip_special_tokens=False) for t in range(len(texts), max_id + 1))
    return texts
