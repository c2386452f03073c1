"""A Hugging Face tokenizer rebuilt from a GGUF file's vocabulary, merges, token types and chat template, with the
pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`."""

from __future__ import annotations

from typing import Any

from nvcli.models.gguf_reader import GGUFError, _field

# Pre-tokenizer regexes, as in the Hugging Face tokenizer.json of each family (and llama.cpp).
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE_TOKENIZERS = ("smollm", "qwen2", "llama-bpe", "gpt-2")

# llama.cpp token types
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def _byte_level_parts(pre: str) -> tuple[Any, Any, bool]:
    """(normalizer, pre_tokenizer, ignore_merges) for llama.cpp's `tokenizer.ggml.pre`."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    if pre == "smollm":
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]), False
    if pre == "qwen2":
        return normalizers.NFC(), pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]), False
    if pre in ("llama-bpe", "llama3"):
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]), True
    if pre == "gpt-2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True), False
    raise GGUFError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (tokenizer.ggml.pre); "
                    f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}. Pass --tokenizer with a Hugging Face "
                    "tokenizer directory for this model")


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece vocabulary, ranked by the merged piece's score.

    The same construction as transformers' SentencePieceExtractor (used for Llama 2's
    tokenizer.json); llama.cpp's SPM tokenizer also merges the pair whose result scores best.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score, ty in zip(tokens, scores, types, strict=True):
        if ty != 1:
            continue
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: m[2], reverse=True)
    return [(a, b) for a, b, _ in merges]


def build_tokenizer(reader: Any, model_max_length: int | None = None) -> Any:
    """A transformers fast tokenizer from the GGUF tokenizer metadata.

    tokenizer.ggml.model "gpt2": byte-level BPE (Llama 3, SmolLM, Qwen2/Qwen3) with the
    pre-tokenizer of tokenizer.ggml.pre; "llama": SentencePiece BPE with byte fallback
    (Llama 2, TinyLlama, Mistral), built like Hugging Face's Llama tokenizer.json.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise GGUFError(f"GGUF tokenizer model {kind!r} is not supported (tokenizer.ggml.model); nv builds "
                        "'gpt2' (byte-level BPE: Llama 3, SmolLM, Qwen2/Qwen3) and 'llama' (SentencePiece: "
                        "Llama 2, Mistral) tokenizers")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or []
    if len(types) != len(tokens):
        types = [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("GGUF vocabulary has duplicate tokens; cannot build a tokenizer from it")

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
        pre = _field(reader, "tokenizer.ggml.pre", "gpt-2")
        normalizer, pre_tokenizer, ignore_merges = _byte_level_parts(pre)
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=ignore_merges))
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
    else:
        scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab, _spm_merges(tokens, list(scores), types), fuse_unk=True,
                                   byte_fallback=True, unk_token=tokens[int(unk_id)] if unk_id is not None else None))
        space_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        norms = ([normalizers.Prepend("\u2581")] if space_prefix else []) + [normalizers.Replace(" ", "\u2581")]
        tok.normalizer = normalizers.Sequence(norms)
        decs = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(decs + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    added = []
    for i, (t, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty in (_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added.append((i, AddedToken(t, special=ty != _TOKEN_USER_DEFINED, normalized=False)))
    for _, a in sorted(added, key=lambda x: x[0]):
        (tok.add_special_tokens if a.special else tok.add_tokens)([a])

    def token(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        b = [f"{bos}:0"] if add_bos else []
        e = [f"{eos}:0"] if add_eos else []
        specials = [(t, vocab[t]) for t in dict.fromkeys(([bos] if add_bos else []) + ([eos] if add_eos else []))]
        tok.post_processor = processors.TemplateProcessing(
            single=[*b, "$A:0", *e], pair=[*b, "$A:0", *e, *b, "$B:1", *e], special_tokens=specials)
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    kwargs: dict[str, Any] = {"clean_up_tokenization_spaces": False}
    for key, hf_key in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"),
                        ("unknown_token_id", "unk_token"), ("padding_token_id", "pad_token")):
        if (t := token(key)) is not None:
            kwargs[hf_key] = t
    template = _field(reader, "tokenizer.chat_template")
    named = {k.removeprefix("tokenizer.chat_template."): _field(reader, k) for k in reader.fields
             if k.startswith("tokenizer.chat_template.")}
    if named:
        kwargs["chat_template"] = {**({"default": template} if template else {}), **named}
    elif template:
        kwargs["chat_template"] = template
    if model_max_length:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


# --------------------------------------------------------------------------------------------
# conversion
