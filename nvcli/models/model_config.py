"""A checkpoint's architecture (`config.json`) as the engine reads it: one typed, validated record.

Why not transformers' `AutoConfig`: constructing any of its model config classes runs their `auto_docstring`
decorator, which imports transformers' modeling and generation packages (and with them scikit-learn,
`torch._dynamo` and `torch.distributed.tensor` where installed): 2.5-3 s of every start-up on the H100 host, a
quarter of a warm one, for a dozen numbers. So the families nv runs (`FAMILIES`)
are read here, with transformers 5's defaults for every key a `config.json` may leave out;
`tests/models/test_model_config.py` checks each default against transformers' own classes. Any other `model_type`
goes through `AutoConfig` as before (`ModelConfig.from_hf`), so nothing that loaded before is read differently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from nvcli.models.layers.rotary import SUPPORTED_ROPE_TYPES

DEFAULT_ROPE_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


@dataclass(frozen=True)
class FamilyDefaults:
    """transformers 5's defaults of one config class for the keys the engine reads."""

    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int
    num_key_value_heads: Optional[int]  # None: as many as the attention heads
    head_dim: Optional[int]  # None: hidden_size // num_attention_heads
    bos_token_id: Optional[int]
    eos_token_id: Optional[int]
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"


# LlamaConfig, Qwen2Config, Qwen3Config and Qwen3MoeConfig of transformers 5 (configuration_{llama,qwen2,qwen3,
# qwen3_moe}.py)
FAMILIES: dict[str, FamilyDefaults] = {
    "llama": FamilyDefaults(vocab_size=32000, intermediate_size=11008, max_position_embeddings=2048,
                            num_key_value_heads=None, head_dim=None, bos_token_id=1, eos_token_id=2),
    "qwen2": FamilyDefaults(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
                            num_key_value_heads=32, head_dim=None, bos_token_id=None, eos_token_id=None),
    "qwen3": FamilyDefaults(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
                            num_key_value_heads=32, head_dim=128, bos_token_id=None, eos_token_id=None),
    "qwen3_moe": FamilyDefaults(vocab_size=151936, intermediate_size=6144, max_position_embeddings=32768,
                                num_key_value_heads=4, head_dim=None, bos_token_id=None, eos_token_id=None,
                                hidden_size=2048, num_hidden_layers=24),
}
# Qwen3MoeConfig's defaults for its mixture-of-experts keys (`num_experts` is also spelled `num_local_experts`: the
# attribute transformers 5 maps it to, and the key its save_pretrained writes)
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=()),
}

TokenIds = Union[int, tuple[int, ...], None]
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")


class ModelConfigError(ValueError):
    """A config.json the engine cannot run: says which key and why."""


@dataclass(frozen=True)
class ModelConfig:
    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain rotary; else the scaling parameters with their "rope_type" (linear, llama3)
    rope_scaling: Optional[Mapping[str, Any]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: TokenIds = None
    eos_token_id: TokenIds = None
    # The attention window of the layers that slide (Qwen2/Qwen3 `use_sliding_window`); None: every layer sees the
    # whole context. The engine attends to the whole context, which is the same thing only up to this many tokens.
    sliding_window: Optional[int] = None
    # Mixture of experts (Qwen3-MoE); num_experts 0: every layer's MLP is dense. A layer i is sparse unless
    # mlp_only_layers names it or (i + 1) is not a multiple of decoder_sparse_step (`is_moe_layer`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The checkpoint's `quantization_config` (None: plain weights). Only block-wise FP8 is read (models/layers/fp8.py):
    # {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": (128, 128)}
    quantization: Optional[Mapping[str, Any]] = None

    def __post_init__(self) -> None:
        optional = ("sliding_window",) if self.sliding_window is not None else ()
        if self.num_experts:
            optional += ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
        for name in _POSITIVE_INTS + optional:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ModelConfigError(f"config.json: hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.num_experts_per_tok > self.num_experts:
            raise ModelConfigError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) is more than "
                                   f"num_experts ({self.num_experts})")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(f"config.json: rope type {rope_type!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` (from 0) runs a sparse mixture-of-experts block instead of a dense MLP."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """A `config.json` of one of FAMILIES, missing keys taking that family's transformers defaults."""
        model_type = d.get("model_type")
        if model_type not in FAMILIES:
            raise ModelConfigError(f"config.json: model_type {model_type!r} is not read here "
                                   f"(read: {', '.join(FAMILIES)}); load it with load_model_config")
        fam = FAMILIES[model_type]

        def get(key: str, default: Any) -> Any:
            value = d.get(key)
            return default if value is None else value

        hidden = get("hidden_size", fam.hidden_size)
        heads = get("num_attention_heads", fam.num_attention_heads)
        # an explicit null derives these from the heads, as transformers' classes and the model code do
        kv_heads = d["num_key_value_heads"] if "num_key_value_heads" in d else fam.num_key_value_heads
        head_dim = d["head_dim"] if "head_dim" in d else fam.head_dim
        max_pos = get("max_position_embeddings", fam.max_position_embeddings)
        return cls(
            architectures=tuple(d.get("architectures") or ()),
            model_type=model_type,
            vocab_size=get("vocab_size", fam.vocab_size),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size", fam.intermediate_size),
            num_hidden_layers=get("num_hidden_layers", fam.num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads if kv_heads is not None else heads,
            head_dim=head_dim if head_dim is not None else hidden // heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(get("rms_norm_eps", fam.rms_norm_eps)),
            **_rope(d, max_pos),
            tie_word_embeddings=bool(get("tie_word_embeddings", fam.tie_word_embeddings)),
            attention_bias=bool(get("attention_bias", fam.attention_bias)),
            hidden_act=get("hidden_act", fam.hidden_act),
            bos_token_id=_token_ids(d.get("bos_token_id", fam.bos_token_id)),
            eos_token_id=_token_ids(d.get("eos_token_id", fam.eos_token_id)),
            sliding_window=_qwen_sliding_window(d, get("num_hidden_layers", fam.num_hidden_layers))
            if model_type in ("qwen2", "qwen3") else _qwen_moe_sliding_window(d) if model_type == "qwen3_moe" else None,
            **_moe(d, MOE_DEFAULTS.get(model_type)),
            quantization=_quantization(d.get("quantization_config")),
        )

    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        """From a transformers config object (any model type)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        rope = _rope({"rope_parameters": getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None),
                      "rope_theta": getattr(config, "rope_theta", None) or DEFAULT_ROPE_THETA},
                     config.max_position_embeddings)
        return cls(
            architectures=tuple(getattr(config, "architectures", None) or ()),
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=float(config.rms_norm_eps),
            **rope,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            hidden_act=getattr(config, "hidden_act", "silu"),
            bos_token_id=_token_ids(getattr(config, "bos_token_id", None)),
            eos_token_id=_token_ids(getattr(config, "eos_token_id", None)),
            # Llama's modeling ignores a window its config may carry
            sliding_window=None if config.model_type == "llama"
            else _sliding_window(getattr(config, "sliding_window", None), getattr(config, "layer_types", None)),
            **_moe_from_hf(config),
            quantization=_quantization(getattr(config, "quantization_config", None)),
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (the compile-ahead marker hashes it)."""
        return {k: (dict(v) if isinstance(v, Mapping) else list(v) if isinstance(v, tuple) else v)
                for k, v in self.__dict__.items()}


def load_model_config(model_dir: Path) -> ModelConfig:
    """`model_dir/config.json` as a ModelConfig; model types outside FAMILIES through transformers' AutoConfig."""
    path = Path(model_dir) / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: no config.json in the model directory") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    if d.get("model_type") in FAMILIES:
        return ModelConfig.from_dict(d)
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))


def _rope(d: Mapping[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """rope_theta and rope_scaling as transformers 5 standardizes them: `rope_scaling` (older files) or
    `rope_parameters` (newer), `rope_theta` beside them as the fallback base, a llama3 / yarn / longrope type's
    pre-training length defaulting to max_position_embeddings."""
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ModelConfigError("config.json: rotary parameters per layer type are not supported")
    theta = params.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta")
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    params.pop("rope_theta", None)
    scaling = None if params["rope_type"] == "default" else params
    return {"rope_theta": float(theta if theta is not None else DEFAULT_ROPE_THETA), "rope_scaling": scaling}


def _qwen_sliding_window(d: Mapping[str, Any], num_layers: int) -> Optional[int]:
    """Qwen2Config / Qwen3Config: a window only with `use_sliding_window`, for the layers from `max_window_layers` on
    unless `layer_types` names them."""
    window = (d["sliding_window"] if "sliding_window" in d else 4096) if d.get("use_sliding_window") else None
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = d.get("max_window_layers")
        first = 28 if first is None else first
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return _sliding_window(window, layer_types)


def _qwen_moe_sliding_window(d: Mapping[str, Any]) -> Optional[int]:
    """Qwen3MoeConfig: a window only with `use_sliding_window`, for every layer (the file's `layer_types`, if any)."""
    window = (d["sliding_window"] if "sliding_window" in d else 4096) if d.get("use_sliding_window") else None
    return _sliding_window(window, d.get("layer_types"))


def _moe(d: Mapping[str, Any], defaults: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The mixture-of-experts fields of a family that has them (`defaults`), else none (a dense model)."""
    if defaults is None:
        return {}
    out = {key: d.get(key) if d.get(key) is not None else default for key, default in defaults.items()}
    if d.get("num_experts") is None and d.get("num_local_experts") is not None:
        out["num_experts"] = d["num_local_experts"]
    out["norm_topk_prob"] = bool(out["norm_topk_prob"])
    out["mlp_only_layers"] = tuple(int(i) for i in out["mlp_only_layers"])
    return out


def _moe_from_hf(config: Any) -> dict[str, Any]:
    """The mixture-of-experts fields of a transformers config with experts (`num_experts` or `num_local_experts`)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return {}
    return dict(num_experts=experts, num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
                norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
                decoder_sparse_step=getattr(config, "decoder_sparse_step", None) or 1,
                mlp_only_layers=tuple(int(i) for i in getattr(config, "mlp_only_layers", None) or ()))


def _quantization(q: Any) -> Optional[Mapping[str, Any]]:
    """A `quantization_config` nv can load, normalized: block-wise FP8 with 128 x 128 blocks and activations
    quantized at run time (DeepSeek-V3's and Qwen3-FP8's); any other scheme is refused here, by name."""
    if q is None:
        return None
    if not isinstance(q, Mapping):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelConfigError(f"config.json: quantization_config quant_method {method!r} is not supported "
                               "(nv loads block-wise fp8 checkpoints)")
    block = q.get("weight_block_size")
    if block is None or [int(b) for b in block] != [128, 128]:
        raise ModelConfigError(f"config.json: quantization_config weight_block_size {block!r} is not supported: nv "
                               "loads block-wise fp8 with [128, 128] blocks (not per-tensor or per-channel scales)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelConfigError(f"config.json: quantization_config activation_scheme {q['activation_scheme']!r} is "
                               "not supported (only dynamic)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ModelConfigError(f"config.json: quantization_config fmt {q['fmt']!r} is not supported (only e4m3)")
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": (128, 128)}


def _sliding_window(window: Optional[int], layer_types: Optional[Any]) -> Optional[int]:
    """The window if some layer slides; a config without `layer_types` (Mistral's) slides every layer."""
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window


def _token_ids(x: Any) -> TokenIds:
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return None if x is None else int(x)
