"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from torch import nn

from nvcli.models.llama import LlamaForCausalLM
from nvcli.models.model_config import ModelConfig
from nvcli.models.qwen2 import Qwen2ForCausalLM
from nvcli.models.qwen3 import Qwen3ForCausalLM
from nvcli.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def model_class(model_config: ModelConfig) -> type[nn.Module]:
    archs = model_config.architectures
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {archs or '(none in config.json)'}; supported: {', '.join(MODEL_REGISTRY)}"
    )
