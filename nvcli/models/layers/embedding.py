"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nvcli.distributed import all_reduce, tp_rank, tp_size
from nvcli.kernels.ops import use_triton
from nvcli.models.layers.norm import RMSNorm


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.start = self.shard_size * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.start : self.start + self.shard_size]
        param.data.zero_()
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        mask = (x >= self.start) & (x < self.start + self.shard_size)
        y = F.embedding((x - self.start) * mask, self.weight)
        y = y * mask.unsqueeze(1).to(y.dtype)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the selected rows, after the model's final add+RMSNorm; with TP the vocab shards are
    gathered on every rank."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, invariant: bool = False
                ) -> torch.Tensor:
        """x, residual: [num_seqs, hidden] -> logits of norm(x + residual) (of norm(x) without a residual):
        [num_seqs, vocab]. `invariant` (--batch-invariant, GPU): the batch-invariant GEMM instead of cuBLAS."""
        from nvcli.models.layers.linear import linear

        # The norm stays a kernel of its own: fused into the LM head's prologue, each of its ~2,400
        # programs (vocab / 64 columns) redid the row's RMS pass. One request on the H100: 1.042-1.048 ms
        # per token fused, 1.028-1.029 unfused (each call beside the same baseline at 1.033-1.037).
        normed = norm(x) if residual is None else norm(x, residual)[0]
        if invariant and use_triton(normed):
            from nvcli.kernels.invariant_matmul import invariant_linear_triton

            logits = invariant_linear_triton(normed, self.weight)  # [num_seqs, vocab shard]
        else:
            logits = linear(normed, self.weight, None)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.num_embeddings]
