"""Llama-family decoder (Llama 2/3, SmolLM2); Qwen2 and Qwen3 reuse it with their own switches.

The model is stateless about scheduling: forward takes packed tokens, their positions and
the step's AttentionMetadata, and returns the last layer's output and residual; `compute_logits`
applies the final add+RMSNorm and the LM head to the rows that need sampling only.

Deferred RMSNorm. A layer's two RMSNorms each feed one projection, so after loading, each norm's weight is
folded into its projection's input columns (`fold_norm_weights`; the norms keep weight 1) and
RMSNorm(h) @ W.T = (h @ W'.T) * rstd(h) row by row. Steps of more than DEFERRED_NORM_MIN_ROWS rows then keep one
residual stream h and run a layer as six kernels instead of eight: qkv = h @ Wqkv'.T; attention, whose rotary step
scales q, k and v by rstd(h); h += o @ Wo.T (cuBLAS adds into h: beta = 1); gate_up = h @ Wgu'.T; SiLU-and-mul, which
scales gate and up by rstd(h); h += act @ Wd.T. In decode steps the two add+RMSNorm kernels per layer are simply gone:
each was a few microseconds of launch and latency in a chain of dependent kernels. Prompt
steps compute rstd(h) once per row with a small kernel instead (a pass over h, where add+RMSNorm made four), and the
rotary and SiLU kernels read it. A few rows keep the fused kernels (the norm in the skinny
GEMM's prologue). Not with tensor parallelism (o_proj and down are summed across ranks after the GEMM), projection
biases (a bias is added after the scaling) or FP8 projections kept in FP8 (layers/fp8.py: a norm weight folded into
fp8 columns would change their block scales, and the deferred path's cuBLAS GEMMs take no fp8 weight).
"""

from __future__ import annotations

import torch
from torch import nn

from nvcli.attention.metadata import AttentionMetadata
from nvcli.distributed import (
    Partial,
    all_reduce,
    begin_forward,
    end_forward,
    reduced,
    set_rank_ordered_sums,
    tp_size,
)
from nvcli.kernels.ops import use_triton
from nvcli.models.layers.activation import SiluAndMul
from nvcli.models.layers.attention import Attention
from nvcli.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nvcli.models.layers.fp8 import RowScaled
from nvcli.models.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear,
)
from nvcli.models.layers.norm import RMSNorm, row_rstd_vector, row_scale
from nvcli.models.layers.rotary import RotaryEmbedding
from nvcli.models.model_config import ModelConfig

# Up to skinny_gemm.MAX_M rows the skinny GEMM computes the norm in its prologue (kernels/skinny_gemm.py): no kernel to save.
DEFERRED_NORM_MIN_ROWS = 17


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.total_heads = config.num_attention_heads
        self.total_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, self.total_heads, self.total_kv_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(self.total_heads * self.head_dim, hidden, bias=False, what="o_proj")
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x), meta)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor | RowScaled, meta: AttentionMetadata,
               partial: bool = False) -> torch.Tensor | Partial | RowScaled:
        """Everything after the qkv projection: qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], or a
        row-scaled FP8 GEMM's (its row scale applied in the rotary kernels). `partial`: o_proj may leave its sum
        across the ranks (or its row scale) to the caller's next add+RMSNorm (forward_partial)."""
        if isinstance(qkv, RowScaled) and use_triton(qkv.values):
            heads = self.attention_heads(positions, qkv.values, meta, qkv.scale, qkv_ratios=qkv.ratios)
        else:  # the torch path: a row-scaled output takes its row and part scales first
            heads = self.attention_heads(positions, qkv.materialize() if isinstance(qkv, RowScaled) else qkv, meta)
        return self.o_proj.forward_partial(heads) if partial else self.o_proj(heads)

    def attention_heads(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        meta: AttentionMetadata,
        scale_rows: torch.Tensor | None = None,  # [num_tokens, hidden]: qkv projects these rows un-normalized (or
        # their 1 / RMS precomputed, [num_tokens] float32: layers.norm.row_scale)
        scale_eps: float = 1e-6,
        qkv_ratios: torch.Tensor | None = None,  # [3] float32 with scale_rows (GPU): q's, k's and v's own factors
        # beside it (a row-scaled FP8 qkv_proj whose parts kept a scale each, layers/fp8.RowScaled)
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim], before o_proj
        """q/k norm, rotary, KV store and attention (what runs is the step's attention plan, in `meta`); with
        `scale_rows` (deferred norm) q, k and v are first scaled by each row's 1 / RMS (inside the rotary kernels on
        the GPU)."""
        if scale_rows is not None and not use_triton(qkv):
            qkv = (qkv.float() * row_scale(scale_rows, scale_eps)).to(qkv.dtype)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        o = self.attn(q, k, v, positions, meta, self.rotary_emb, q_norm, k_norm, scale_rows, scale_eps, qkv_ratios)
        return o.flatten(1)


class DecoderMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, what="down_proj")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # the Triton path: DecoderLayer.forward


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool, mlp: nn.Module | None = None) -> None:
        """`mlp`: the layer's feed-forward block (default: the dense DecoderMLP; models/qwen3_moe.py passes experts)."""
        super().__init__()
        self.self_attn = DecoderAttention(config, qkv_bias, qk_norm)
        self.mlp = mlp if mlp is not None else DecoderMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, (Partial, RowScaled)) or use_triton(x):
            # add+RMSNorm fused into the next projection (one kernel for a few rows); under tensor parallelism the
            # row-parallel projections leave their sums to that add+RMSNorm where they can (a Partial: the layer's
            # output too, summed by the next layer's input norm or at the end of the model)
            x, residual = self.attention_block(positions, x, residual, meta, partial=True)
            norm, down = self.post_attention_layernorm, self.mlp.down_proj
            gate_up, residual = self.mlp.gate_up_proj.forward_norm(x, residual, norm.weight, norm.eps)
            return down.forward_silu_mul_partial(gate_up), residual
        x, residual = self.attention_block(positions, x, residual, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def attention_block(
        self, positions: torch.Tensor, x: torch.Tensor | Partial, residual: torch.Tensor | None,
        meta: AttentionMetadata, partial: bool = False
    ) -> tuple[torch.Tensor | Partial, torch.Tensor]:
        """The input add+RMSNorm and attention: (attention's output before the residual add, the residual); x may be
        the previous layer's Partial; `partial`: the output may be one too (DecoderAttention.attend)."""
        if isinstance(x, (Partial, RowScaled)) or use_triton(x):  # add+RMSNorm fused into the qkv projection
            norm = self.input_layernorm
            qkv, residual = self.self_attn.qkv_proj.forward_norm(x, residual, norm.weight, norm.eps)
            return self.self_attn.attend(positions, qkv, meta, partial), residual
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn(positions, x, meta), residual

    def forward_invariant(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` on the GPU under --batch-invariant: every kernel keeps one configuration whatever the row count
        (row-wise norm, rotary and SiLU kernels; kernels/invariant_matmul.py for the projections; one tile shape of
        the prefill attention kernel for prompt and decode rows alike), so a row's result depends on that row only."""
        from nvcli.kernels.invariant_matmul import invariant_linear_triton as mm

        attn, mlp = self.self_attn, self.mlp
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        qkv = mm(x, attn.qkv_proj.weight, attn.qkv_proj.bias)  # [num_tokens, (H + 2 * KH) * head_dim]
        o = attn.attention_heads(positions, qkv, meta)  # [num_tokens, H * head_dim]
        o = all_reduce(mm(o, attn.o_proj.weight, attn.o_proj.bias))  # rank-ordered under TP (distributed.py)
        x, residual = self.post_attention_layernorm(o, residual)
        act = mlp.act(mm(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias))  # [num_tokens, intermediate]
        return all_reduce(mm(act, mlp.down_proj.weight, mlp.down_proj.bias)), residual

    def forward_deferred(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer on the residual stream h [num_tokens, hidden], updated in place and returned (deferred norm,
        see the module docstring; the norms' weights are folded into qkv_proj and gate_up_proj)."""
        attn, mlp = self.self_attn, self.mlp
        eps_in, eps_post = self.input_layernorm.eps, self.post_attention_layernorm.eps
        # Decode steps: each program of the rotary step and of SiLU computes its row's 1 / RMS from the row (no
        # kernel for it). Prompt steps run several programs per row (rotary: one per KV head; SiLU: one per 1,024
        # columns): there one small kernel computes each row's 1 / RMS once and they read that.
        per_program = meta.decode_only
        qkv = linear(h, attn.qkv_proj.weight, None)  # [num_tokens, (H + 2 * KH) * head_dim] of the un-normed rows
        scale = h if per_program else row_rstd_vector(h, eps_in)
        o = attn.attention_heads(positions, qkv, meta, scale, eps_in)  # [num_tokens, H * head_dim]
        h.addmm_(o, attn.o_proj.weight.t())  # h += o_proj(o), summed inside the GEMM
        gate_up = linear(h, mlp.gate_up_proj.weight, None)
        act = mlp.act(gate_up, h if per_program else row_rstd_vector(h, eps_post), eps_post)  # [num_tokens, inter]
        return h.addmm_(act, mlp.down_proj.weight.t())

    def fold_norm_weights(self) -> None:
        """Fold each norm's weight into the projection it feeds, leaving the norm at weight 1: the same function,
        and the form `forward_deferred` needs. Not into FP8 weights (see the module docstring)."""
        if self.has_fp8:
            return
        for norm, proj in ((self.input_layernorm, self.self_attn.qkv_proj), (self.post_attention_layernorm,
                                                                              self.mlp.gate_up_proj)):
            w = proj.weight.data  # [out, hidden]
            w.copy_((w.float() * norm.weight.data.float()[None, :]).to(w.dtype))
            norm.weight.data.fill_(1.0)

    @property
    def has_fp8(self) -> bool:
        """Whether a projection of the layer holds FP8 weights (kept so after loading: layers/fp8.py)."""
        return any(isinstance(m, LinearBase) and m.fp8 is not None for m in self.modules())

    @property
    def can_defer_norm(self) -> bool:
        return not self.has_fp8 and all(p.bias is None for p in (self.self_attn.qkv_proj, self.self_attn.o_proj,
                                                                 self.mlp.gate_up_proj, self.mlp.down_proj))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, qkv_bias, qk_norm, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # set by fold_norm_weights: the norms' weights are in the projections and every layer can run deferred
        self.can_defer_norm = False
        self.batch_invariant = False  # --batch-invariant: set by LlamaForCausalLM.set_batch_invariant

    def make_layer(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool, index: int) -> nn.Module:
        """Decoder layer `index` (a subclass may build another kind per layer)."""
        return DecoderLayer(config, qkv_bias, qk_norm)

    def fold_norm_weights(self) -> None:
        for layer in self.layers:
            layer.fold_norm_weights()
        self.can_defer_norm = (bool(self.layers) and tp_size() == 1
                               and all(layer.can_defer_norm for layer in self.layers))

    def defers_norm(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` rows runs the deferred-norm layers (module docstring)."""
        return num_tokens >= DEFERRED_NORM_MIN_ROWS and self.can_defer_norm

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) [num_tokens, hidden] each: the final norm's inputs (see compute_logits); residual None
        when x is the whole residual stream (deferred norm)."""
        if self.batch_invariant:
            return self._forward_invariant(input_ids, positions, meta)
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.defers_norm(x.shape[0]):
            for layer in self.layers:
                x = layer.forward_deferred(positions, x, meta)
            return x, None
        residual = torch.zeros_like(x) if not self.layers else None
        begin_forward()
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x = reduced(x)  # the last layer's down projection, if not yet summed across the ranks
        if isinstance(x, RowScaled):  # ... or not yet scaled (a row-scaled FP8 down projection)
            x = x.materialize()
        end_forward()
        return x, residual


    def _forward_invariant(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` under --batch-invariant. On the GPU the rows go through DecoderLayer.forward_invariant together.
        On the CPU the torch ops' reduction orders change with the row count (MKL takes one row as a matrix-vector
        product, several as a matrix product), so every row runs alone, as a one-token decode step at its position,
        in the step's order: a prompt row then finds the rows before it already in the cache, and a prompt token is
        computed exactly as it would be decoded."""
        if use_triton(input_ids):
            x, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden]
            for layer in self.layers:
                x, residual = layer.forward_invariant(positions, x, residual, meta)
            return x, residual
        starts = meta.query_start_loc.tolist()
        outs = []
        for seq, (a, b) in enumerate(zip(starts, starts[1:])):
            for r in range(a, b):
                pos = int(positions[r])
                one = AttentionMetadata(
                    slot_mapping=meta.slot_mapping[r : r + 1], query_start_loc=meta.query_start_loc.new_tensor([0, 1]),
                    seq_lens=meta.seq_lens.new_tensor([pos + 1]), block_tables=meta.block_tables[seq : seq + 1],
                    max_query_len=1, max_seq_len=pos + 1, decode_only=True)
                x, residual = self.embed_tokens(input_ids[r : r + 1]), None  # [1, hidden]
                for layer in self.layers:
                    x, residual = layer(positions[r : r + 1], x, residual, one)
                outs.append((x, residual))
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    decoder_class: type[DecoderModel] = DecoderModel
    # checkpoint name fragment -> (our parameter fragment, shard id of a fused layer)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.decoder_class(config, self.qkv_bias or config.attention_bias, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = config.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp_size = tp_size()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last decoder layer's (output, residual), [num_tokens, hidden] each (residual None: the output is the
        residual stream), before the final norm."""
        return self.model(input_ids, positions, meta)

    def fold_norm_weights(self) -> None:
        """After loading: each decoder norm's weight into the projection it feeds (DecoderLayer.fold_norm_weights)."""
        self.model.fold_norm_weights()

    def set_batch_invariant(self, on: bool) -> None:
        """--batch-invariant: every row's logits independent of the other rows of its step (_forward_invariant)."""
        self.model.batch_invariant = on
        set_rank_ordered_sums(on)

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Logits [num_seqs, vocab] of LM-head(RMSNorm(hidden + residual)) for the selected rows [num_seqs, hidden]
        (residual None: of RMSNorm(hidden))."""
        if self.model.batch_invariant and not use_triton(hidden):  # one row at a time (DecoderModel._forward_invariant)
            return torch.cat([self.lm_head(hidden[i : i + 1], None if residual is None else residual[i : i + 1],
                                           self.model.norm) for i in range(hidden.shape[0])])
        return self.lm_head(hidden, residual, self.model.norm, invariant=self.model.batch_invariant)

