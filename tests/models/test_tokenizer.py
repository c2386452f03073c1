"""models/tokenizer.py: the directly loaded tokenizer is the one AutoTokenizer gives, and behaves the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nvcli.models.tokenizer import DIRECT_CLASSES, direct_class_name, load_tokenizer
from nvcli.testing.tiny_models import qwen_tokenizer_dir, tiny_config

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines\r\n",
    "naïve café — 東京 🚀 emoji",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def _tokenizer_dir(root: Path, model_type: str, tokenizer_class: str, **settings: object) -> Path:
    """The Qwen tokenizer files under a `model_type` config.json, naming `tokenizer_class`."""
    path = root / f"{model_type}-{tokenizer_class}"
    path.mkdir()
    src = qwen_tokenizer_dir()
    shutil.copy(src / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class, **settings}))
    (path / "config.json").write_text(json.dumps(tiny_config(model_type)))
    return path


@pytest.mark.parametrize("pair", list(DIRECT_CLASSES), ids=["-".join(p) for p in DIRECT_CLASSES])
def test_the_direct_class_is_autotokenizers_and_tokenizes_alike(tmp_path: Path, pair: tuple[str, str]) -> None:
    from transformers import AutoTokenizer

    path = _tokenizer_dir(tmp_path, *pair)
    assert direct_class_name(path) == DIRECT_CLASSES[pair]
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    assert len(ours) == len(auto)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(ours, attr) == getattr(auto, attr), attr
    assert ours(TEXTS).input_ids == auto(TEXTS).input_ids
    assert ours(TEXTS, add_special_tokens=False).input_ids == auto(TEXTS, add_special_tokens=False).input_ids
    ids = auto("<|im_start|>naïve 東京<|im_end|>").input_ids
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    kwargs = dict(tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES, **kwargs) == auto.apply_chat_template(MESSAGES, **kwargs)


@pytest.mark.parametrize("case", ["unlisted class", "remote code", "no tokenizer.json", "no config.json",
                                  "broken tokenizer_config.json"])
def test_anything_else_goes_through_autotokenizer(tmp_path: Path, case: str) -> None:
    """Pairs not checked above, remote code and incomplete directories take AutoTokenizer's resolution."""
    if case == "unlisted class":
        path = _tokenizer_dir(tmp_path, "qwen3", "TokenizersBackend")
    elif case == "remote code":
        path = _tokenizer_dir(tmp_path, "qwen3", "Qwen2Tokenizer",
                              auto_map={"AutoTokenizer": [None, "tokenization_x.XTokenizer"]})
    else:
        path = _tokenizer_dir(tmp_path, "qwen3", "Qwen2Tokenizer")
        if case == "no tokenizer.json":
            (path / "tokenizer.json").unlink()
        elif case == "no config.json":
            (path / "config.json").unlink()
        else:
            (path / "tokenizer_config.json").write_text("{broken")
    assert direct_class_name(path) is None


def test_an_unlisted_pair_loads_as_autotokenizer_loads_it(tmp_path: Path) -> None:
    """(qwen3, TokenizersBackend) is not in the table; AutoTokenizer resolves it (its own rules) and nv gets that."""
    from transformers import AutoTokenizer

    path = _tokenizer_dir(tmp_path, "qwen3", "TokenizersBackend")
    assert type(load_tokenizer(path)) is type(AutoTokenizer.from_pretrained(path))
