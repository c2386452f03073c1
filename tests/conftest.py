from __future__ import annotations

import copy
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _environment_read_afresh():
    """nvcli.env reads the environment once per process: each test reads it again on first use, so a variable a
    fixture or an earlier test set (monkeypatch) counts exactly while it is set."""
    from nvcli import env

    env.settings.cache_clear()
    yield
    env.settings.cache_clear()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model_dir("qwen3"|"qwen2"|"llama") -> path of a random tiny checkpoint."""
    from nvcli.testing.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, Path] = {}

    def make(arch: str = "qwen3") -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(root / arch, arch)
        return cache[arch]

    return make


def _directory_state(path: Path) -> tuple | None:
    """What a tokenizer loaded from `path` depends on: its files' names, sizes and modification times (None for a
    hub id or a missing directory, which are not cached)."""
    try:
        if not path.is_dir():
            return None
        return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir() if f.is_file()))
    except OSError:
        return None


@pytest.fixture(scope="session", autouse=True)
def _tokenizers_loaded_once_per_directory():
    """Loading the Qwen3 tokenizer (151k tokens) is 0.6 s of every tiny engine's 0.65 s start on the 2-core CI machine,
    and hundreds of tests start an engine on the same few directories. nvcli.models.tokenizer.load_tokenizer runs for
    real the first time a directory (in the state of its files) is loaded; later engines get a copy of that tokenizer
    whose own settings (chat_template, special tokens, limits) are its own, sharing only the read-only vocabulary and
    the Rust backend. tests/models/test_tokenizer.py calls the real function (imported before this patch)."""
    from nvcli.models import tokenizer as module

    real = module.load_tokenizer
    cache: dict[tuple, object] = {}

    def load_tokenizer(name_or_path):
        path = Path(name_or_path)
        state = _directory_state(path)
        if state is None:
            return real(name_or_path)
        key = (str(path.resolve()), state)
        if key not in cache:
            cache[key] = real(name_or_path)
        tok = copy.copy(cache[key])
        for name, value in vars(tok).items():  # the tokenizer's own settings; the vocabulary and merges stay shared
            if isinstance(value, (dict, list, set)) and name not in ("_vocab", "_merges"):
                setattr(tok, name, copy.copy(value))
        return tok

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "load_tokenizer", load_tokenizer)
        yield


@pytest.fixture(scope="session", autouse=True)
def _grammar_tokenizers_built_once():
    """A structured-output engine builds llguidance's form of its tokenizer (llguidance.hf.from_tokenizer: 1-1.5 s for
    Qwen3's vocabulary on the CI machine) at its first constrained request. The result is an immutable Rust object
    that depends only on the tokenizer's backend, the vocabulary size and the EOS ids: later engines on a tokenizer
    from the cache above (which share its backend) get the one already built. Any other tokenizer builds its own."""
    try:
        import llguidance.hf
    except ImportError:  # the engine reports it where a test needs it
        yield
        return

    real = llguidance.hf.from_tokenizer
    cache: dict[tuple, tuple[object, object]] = {}

    def from_tokenizer(hf_tokenizer, n_vocab=None, eos_token=None, *args, **kwargs):
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        if backend is None or args or kwargs:
            return real(hf_tokenizer, n_vocab, eos_token, *args, **kwargs)
        eos = tuple(eos_token) if isinstance(eos_token, (list, tuple)) else eos_token
        key = (id(backend), n_vocab, eos)
        if key not in cache:  # the backend is kept with its result: its id is not reused while cached
            cache[key] = (backend, real(hf_tokenizer, n_vocab, eos_token))
        return cache[key][1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llguidance.hf, "from_tokenizer", from_tokenizer)
        yield
