"""Qwen3-MoE (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): Qwen3's decoder with a sparse mixture-of-experts block
in place of the dense MLP in every layer that `ModelConfig.is_moe_layer` names (layers/moe.py); the layers of
`mlp_only_layers` (or off the `decoder_sparse_step`) keep Qwen3's dense MLP of `intermediate_size`.

Attention is Qwen3's (q/k norm, no bias). A MoE layer does not run the deferred norm of models/llama.py: the
normed rows feed both the router and the experts, so its norm stays a kernel of its own (its weight is not folded),
and a model with any MoE layer runs every layer with its norms (`can_defer_norm` False).

Checkpoints: the per-expert tensors Qwen publishes (and transformers 5.17's save_pretrained writes),
`model.layers.L.mlp.experts.{i}.{gate,up,down}_proj.weight`, and the fused `mlp.experts.gate_up_proj` /
`mlp.experts.down_proj` of transformers 5's in-memory layout both load (`checkpoint_target`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import nn

from nvcli.attention.metadata import AttentionMetadata
from nvcli.distributed import all_reduce
from nvcli.models.layers.moe import SparseMoeBlock
from nvcli.models.llama import DecoderLayer, DecoderModel
from nvcli.models.model_config import ModelConfig
from nvcli.models.qwen3 import Qwen3ForCausalLM

_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is a SparseMoeBlock: attention as in DecoderLayer, then add+RMSNorm and the block."""

    mlp: SparseMoeBlock

    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool) -> None:
        moe = SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                             config.moe_intermediate_size, config.norm_topk_prob)
        super().__init__(config, qkv_bias, qk_norm, mlp=moe)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attention_block(positions, x, residual, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_invariant(
        self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer.forward_invariant with the experts: router and grouped GEMMs in one configuration whatever
        the row count."""
        from nvcli.kernels.invariant_matmul import invariant_linear_triton as mm

        attn = self.self_attn
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        o = attn.attention_heads(positions, mm(x, attn.qkv_proj.weight, attn.qkv_proj.bias), meta)
        o = all_reduce(mm(o, attn.o_proj.weight, attn.o_proj.bias))
        x, residual = self.post_attention_layernorm(o, residual)
        return self.mlp(x, invariant=True), residual

    def forward_deferred(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError("a MoE layer runs with its norms (can_defer_norm is False)")

    def fold_norm_weights(self) -> None:
        """Nothing folded: the post-attention norm feeds the router and the experts, and the layer never defers."""

    @property
    def can_defer_norm(self) -> bool:
        return False


class Qwen3MoeModel(DecoderModel):
    def make_layer(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool, index: int) -> nn.Module:
        if config.is_moe_layer(index):
            return MoeDecoderLayer(config, qkv_bias, qk_norm)
        return DecoderLayer(config, qkv_bias, qk_norm)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    decoder_class = Qwen3MoeModel

    def checkpoint_target(self, name: str) -> Optional[tuple[str, Any]]:
        """(parameter, shard) of a checkpoint's per-expert tensor (FusedMoE.weight_loader), else None (loader.py
        maps the name as for any model)."""
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            return None
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down_proj":
            return f"{prefix}.down_proj", (expert, None)
        return f"{prefix}.gate_up_proj", (expert, 0 if proj == "gate_proj" else 1)
