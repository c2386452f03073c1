"""Qwen2 / Qwen2.5: the Llama decoder with a bias on the q, k and v projections."""

from __future__ import annotations

from nvcli.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    qk_norm = False
