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


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_vocabulary_decodes_at_once_as_token_by_token(clean_up: bool) -> None:
    """Logprobs show each token's own text: the whole vocabulary, decoded at once the first time they are asked for,
    reads as decoding each id alone, special tokens kept, with transformers' space clean-up where the tokenizer asks
    for it (" ." -> "." and the like; the backend's batch does not do it, so such a tokenizer is caught and decoded
    through transformers)."""
    from transformers import AutoTokenizer

    from nvcli.models.tokenizer import vocabulary_texts

    force = {"clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True} if clean_up else {}
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir(), clean_up_tokenization_spaces=clean_up, **force)
    texts = vocabulary_texts(tok)
    assert len(texts) == len(tok)
    punct = [tok.encode(t, add_special_tokens=False)[0] for t in (" .", " ,", " !", " ?", " n't", " 's")]
    ids = [*range(0, len(tok), 97), *tok.all_special_ids, *punct, len(tok) - 1]
    assert [texts[i] for i in ids] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert (texts[punct[0]] == ".") == clean_up  # the clean-up does apply to single tokens


def test_a_tokenizer_without_a_rust_backend_decodes_through_batch_decode() -> None:
    from nvcli.models.tokenizer import vocabulary_texts

    class Slow:
        def __len__(self) -> int:
            return 3

        def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
            assert not skip_special_tokens
            return [f"<{i[0]}>" for i in ids]

    assert vocabulary_texts(Slow()) == ["<0>", "<1>", "<2>"]
