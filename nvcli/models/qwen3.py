"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys, no qkv bias."""

from __future__ import annotations

from nvcli.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    qk_norm = True
