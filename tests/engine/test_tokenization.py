"""LLMEngine's tokenizing methods: a batch encodes exactly as one text at a time."""

from __future__ import annotations

import pytest

from nvcli.engine.llm_engine import LLMEngine
from nvcli.testing.tiny_models import qwen_tokenizer_dir

TEXTS = ["Hello world!", "  leading spaces\n\ttabs", "naïve café — «quotes» 日本語 🙂", "x" * 3000,
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2"]


class _TokenizerOnly:
    """LLMEngine's tokenizing methods over the real Qwen3 tokenizer, without a model."""

    encode = LLMEngine.encode
    encode_batch = LLMEngine.encode_batch
    render_chat_text = LLMEngine.render_chat_text
    render_chat = LLMEngine.render_chat

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def eng() -> _TokenizerOnly:
    return _TokenizerOnly()


def test_encode_batch_equals_encode_per_text(eng: _TokenizerOnly):
    batch = eng.encode_batch(TEXTS)
    assert batch == [eng.encode(t) for t in TEXTS]
    assert eng.encode_batch([]) == []


def test_chat_text_encoded_in_a_batch_equals_render_chat(eng: _TokenizerOnly):
    convs = [[{"role": "user", "content": t}] for t in TEXTS]
    texts = [eng.render_chat_text(c) for c in convs]
    assert all(t.endswith("<|im_start|>assistant\n") for t in texts)
    assert eng.encode_batch(texts, add_special_tokens=False) == [eng.render_chat(c) for c in convs]
