"""Built-in dummy-weight presets: a model dir that transformers loads like a downloaded checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nvcli.models.presets import PRESETS, preset_dir


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_preset_tokenizer_loads_without_warnings(tmp_path: Path) -> None:
    """A preset's tokenizer loads quietly: no warning on stderr that its tokenization is wrong (transformers 5
    warns about any local config.json that does not name the transformers version that wrote it)."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = preset_dir("qwen3-0.6b", tmp_path)
    records = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
    finally:
        logger.removeHandler(records)
    assert records.messages == []
    assert tokenizer("hello world").input_ids == [14990, 1879]
    assert config.num_hidden_layers == 28 and config.vocab_size == 151936


def test_unknown_preset_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        preset_dir("qwen3-70b", tmp_path)
    assert set(PRESETS) >= {"qwen3-0.6b", "qwen3-8b", "llama-3-8b"}
