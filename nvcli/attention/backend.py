"""The attention backend: a step's attention plan, its metadata and the attention part of the CUDA graphs' inputs.

The plan decides, per step, on the host:
- decode order: a graph's one-token rows go to the decode kernel's programs longest first;
- the split of a mixed step (GPU): its one-token rows go to the decode kernel, its prompt chunks to the prefill
  kernel (DecodeSplit);
- shared-prefix groups (GPU decode and mixed graphs): rows that begin with the same cached pages read them once
  per group (attention/plan.py);
- the invariant form (--batch-invariant): one kernel shape for every row.
The kernel calls that follow from the plan are in attention/forward.py; layers call one forward.

Graph inputs. A CUDA graph of `rows` one-token rows and `chunks` prompt chunks reads its attention inputs from
static buffers: `attn_i32` (lengths and program order of the one-token rows, the chunks' query starts and lengths,
shared tokens per group of rows), `tables` [rows, width] and `pre_tables` [chunks, width]. The graph room
(engine/cuda_graphs.py) lays them out beside its own fields; this class stages a step into them and builds the
metadata a graph is captured with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from nvcli.attention.metadata import AttentionMetadata, DecodeSplit
from nvcli.attention.plan import longest_first, num_groups, shared_prefix_plan

Field = tuple[str, torch.dtype, tuple[int, ...]]
Upload = Callable[[np.ndarray], torch.Tensor]


def fill_tables(out: np.ndarray, tables: Sequence[Sequence[int]]) -> None:
    """Row i of `out` starts with table i; entries past a table's length keep what they held (kernels read a
    sequence's table only up to its length). A sequence's table (engine/sequence.BlockTable) is copied from its int32
    mirror."""
    if tables and hasattr(tables[0], "array"):  # a step's tables are all BlockTables or all lists
        for i, b in enumerate(tables):
            out[i, : len(b)] = b.array()
    else:
        for i, b in enumerate(tables):
            out[i, : len(b)] = b


def pad_tables(tables: Sequence[Sequence[int]]) -> np.ndarray:
    """int32 [len(tables), longest]: each table, zero-padded."""
    out = np.zeros((len(tables), max(len(b) for b in tables)), dtype=np.int32)
    fill_tables(out, tables)
    return out


class AttentionBackend:
    def __init__(self, device: torch.device, block_size: int, max_blocks: int, seqs_per_group: int,
                 invariant: bool) -> None:
        """`max_blocks`: a max_model_len sequence's table width; `seqs_per_group`: the shared-prefix kernel's rows
        per group (kernels/shared_prefix_attention.seqs_per_group); `invariant`: --batch-invariant."""
        self.device = device
        self.gpu = device.type == "cuda"
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.seqs_per_group = seqs_per_group
        self.invariant = invariant
        self.split_mixed = self.gpu  # the split of mixed steps: decode kernel for one-token rows (GPU kernels)
        # whether decode and mixed graphs may read shared prefixes: set by the runner once the cache exists and the
        # graphs are known (not under --batch-invariant, whose attention takes every row alike)
        self.shared_prefix = False
        self._one_row_starts: torch.Tensor | None = None

    # ------------------------------------------------------------------ eager steps
    def metadata(self, slot_mapping: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                 block_tables: Sequence[Sequence[int]], decode_only: bool, num_decode_rows: int,
                 upload: Upload) -> AttentionMetadata:
        """The metadata of a step launched eagerly; `upload` copies a host array to the device."""
        lens = np.asarray(seq_lens, dtype=np.int32)
        qsl = upload(np.asarray(query_start_loc, dtype=np.int32))
        seq_lens_dev = upload(lens)
        tables = upload(pad_tables(block_tables))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens_dev, block_tables=tables,
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            max_seq_len=int(lens.max()), decode_only=decode_only, invariant=self.invariant and self.gpu)
        d = num_decode_rows
        if d and not decode_only and self.split_mixed:
            prompt_starts = query_start_loc[d:]
            meta.split = DecodeSplit(
                num_rows=d, seq_lens=seq_lens_dev[:d], block_tables=tables[:d],
                order=upload(longest_first(lens[:d]).astype(np.int32)), prefill_query_start_loc=qsl[d:],
                prefill_seq_lens=seq_lens_dev[d:], prefill_block_tables=tables[d:],
                prefill_max_query_len=max([b - a for a, b in zip(prompt_starts, prompt_starts[1:])], default=0))
        return meta

    # ------------------------------------------------------------------ CUDA graphs
    def graph_fields(self, rows: int, chunks: int) -> list[Field]:
        """The static attention inputs of graphs of up to `rows` one-token rows and `chunks` prompt chunks."""
        scalars = 2 * rows + num_groups(rows, self.seqs_per_group) + (2 * chunks + 1 if chunks else 0)
        fields: list[Field] = [("attn_i32", torch.int32, (scalars,)), ("tables", torch.int32, (rows, self.max_blocks))]
        if chunks:
            fields.append(("pre_tables", torch.int32, (chunks, self.max_blocks)))
        return fields

    def graph_views(self, views: dict[str, torch.Tensor], rows: int, chunks: int) -> dict[str, torch.Tensor]:
        """`views` (one copy of graph_fields(rows, chunks), device or pinned) with attn_i32 cut into its parts."""
        i32 = views["attn_i32"]
        parts = {"lens": i32[:rows], "order": i32[rows : 2 * rows]}
        at = 2 * rows
        if chunks:
            parts["pre_qsl"] = i32[at : at + chunks + 1]
            parts["pre_lens"] = i32[at + chunks + 1 : at + 2 * chunks + 1]
            at += 2 * chunks + 1
        parts["shared"] = i32[at:]
        return {**views, **parts}

    def reset_graph_inputs(self, dev: dict[str, torch.Tensor]) -> None:
        """Static inputs that read no KV (lengths 0, chunks empty, no shared tokens): what a capture runs over."""
        dev["attn_i32"].zero_()

    def graph_metadata(self, dev: dict[str, torch.Tensor], slots: torch.Tensor, tokens: int, rows: int, chunks: int,
                       shared: bool) -> AttentionMetadata:
        """The metadata a graph of `tokens` tokens, `rows` one-token rows and `chunks` prompt chunks (0: a decode
        graph, tokens == rows) is captured with, over the static inputs `dev` (graph_views); `shared`: its one-token
        rows read the shared tokens staged per group."""
        span = self.max_blocks * self.block_size
        shared_len = dev["shared"][: num_groups(rows, self.seqs_per_group)] if shared else None
        if not chunks:
            if self._one_row_starts is None:
                self._one_row_starts = torch.arange(dev["lens"].shape[0] + 1, dtype=torch.int32, device=self.device)
            return AttentionMetadata(slots[:rows], self._one_row_starts[: rows + 1], dev["lens"][:rows],
                                     dev["tables"][:rows], 1, span, True, dev["order"][:rows],
                                     shared_prefix_len=shared_len, invariant=self.invariant)
        pre_qsl, pre_lens, pre_tables = dev["pre_qsl"][: chunks + 1], dev["pre_lens"][:chunks], dev["pre_tables"][:chunks]
        split = DecodeSplit(rows, dev["lens"][:rows], dev["tables"][:rows], dev["order"][:rows], pre_qsl, pre_lens,
                            pre_tables, tokens, shared_prefix_len=shared_len)
        return AttentionMetadata(slots[:tokens], pre_qsl, pre_lens, pre_tables, tokens, span, False, None, split,
                                 invariant=self.invariant)

    def stage(self, host: dict[str, np.ndarray], seq_lens: Sequence[int], query_start_loc: Sequence[int],
              block_tables: Sequence[Sequence[int]], num_tokens: int, rows: int, row_capacity: int,
              chunk_capacity: int) -> bool:
        """Stage a step's attention inputs into a graph's pinned buffers (numpy views of graph_views): its first
        `rows` sequences compute one token each, the rest are prompt chunks; capacities are the graph's. Unused
        entries read nothing (length 0, empty chunks). Returns whether the one-token rows read a shared prefix."""
        lens = host["lens"]
        lens[:rows] = seq_lens[:rows]
        lens[rows:row_capacity] = 0
        fill_tables(host["tables"], block_tables[:rows])
        if chunk_capacity:
            p = len(seq_lens) - rows
            pre_qsl, pre_lens = host["pre_qsl"], host["pre_lens"]
            pre_qsl[: p + 1] = query_start_loc[rows:]
            pre_qsl[p + 1 : chunk_capacity + 1] = num_tokens
            pre_lens[:p] = seq_lens[rows:]
            pre_lens[p:chunk_capacity] = 0
            fill_tables(host["pre_tables"], block_tables[rows:])
        order, shared = host["order"], host["shared"]
        plan = (shared_prefix_plan(host["tables"], lens[:rows], self.block_size, self.seqs_per_group)
                if self.shared_prefix else None)
        if plan is None:  # the ordinary kernel's programs take the longest sequences first; padding rows come last
            order[:row_capacity] = longest_first(lens[:row_capacity])
            return False
        order[:rows], groups = plan
        order[rows:row_capacity] = np.arange(rows, row_capacity)
        shared[: len(groups)] = groups
        shared[len(groups) : num_groups(row_capacity, self.seqs_per_group)] = 0
        return True
