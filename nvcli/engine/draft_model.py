"""Speculative decoding with a draft model (`--speculative-config '{"model": DIR, "num_speculative_tokens": k}'`).

A small model sharing the target's tokenizer proposes k tokens greedily (argmax); the target verifies them as it
verifies n-gram drafts (engine/spec_decode.py). Greedy drafts are a deterministic function of the context, so the
acceptance rule there keeps the output exactly the target's: greedy tokens identical, seeded draws unchanged.

Where it runs. In the engine's process, on rank 0's device and in the target's dtype, whole at any --tp (built and
run inside distributed.single_rank()). On a GPU its forwards replay CUDA graphs of its own (engine/cuda_graphs.py,
its own pool): decode graphs of up to disable_by_batch_size rows for the one-token forwards, and mixed graphs of up to
GRAPH_TOKENS tokens for the first forward of a step (1 or 2 unseen tokens a row after a verify step); a larger first
forward (a sequence catching up) runs eagerly. Eagerly a draft step of a small model is the host's launch time
(k of them before every verify step), which is what the graphs remove.

Its KV cache. Its own paged cache with as many blocks as the target's and the target's block size, read and written
through the TARGET's block tables: the draft's KV of block b lives at index b of its own cache, so no second block
manager exists. KV sizing counts both caches' bytes per block (kv_sizing.draft_kv_bytes_per_block). A block shared through the
prefix cache may be rewritten by the draft of any sequence holding it; each writes the values of the same tokens at
the same positions, so the rewrite is harmless.

Per sequence, `valid` counts the leading tokens whose draft KV the draft has computed from the sequence's own
tokens. A step's drafts come in two halves around the scheduler:
- `propose` (before scheduling) picks the rows that speculate, by the rules n-gram drafting uses, and returns
  placeholders for their drafts; the scheduler allocates KV blocks for them as for any drafts, and may cut them to
  its token budget.
- `fill` (after scheduling, before the target's forward) runs the draft for the rows that kept drafts: one forward
  over every row's unseen tokens [valid, n) (a prompt-like chunk; n = the tokens known before the step), whose last
  row's argmax is d1, then k - 1 one-token forwards feeding d1.. back, each writing tentative KV at positions n,
  n + 1, ... All rows go in each forward together. The drafts replace the placeholders in token_ids.
A constrained sequence's drafts follow its grammar: a copy of its state (GrammarState.cursor) runs
ahead over them, and each draft is the draft's argmax among the tokens allowed there, as the target samples under the
same mask. After verification the tentative KV at position n + i counts as valid exactly where the sequence kept the token
d(i+1) there (checked lazily at the next proposal). A preempted sequence (its blocks freed) starts again from 0.
A sequence whose unseen tokens do not fit this step's draft budget (max_num_batched_tokens tokens in the first
forward) does not speculate; the draft processes a chunk of its computed tokens instead ("catching up").
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import numpy as np
import torch

from nvcli.config import ConfigError, EngineConfig
from nvcli.distributed import single_rank
from nvcli.engine import startup
from nvcli.engine.cuda_graphs import CudaGraphs
from nvcli.engine.model_runner import eager_inputs, upload_ints
from nvcli.engine.scheduler import ScheduledBatch
from nvcli.engine.sequence import Sequence, SequenceStatus
from nvcli.engine.spec_backoff import kept_drafts
from nvcli.engine.spec_decode import Proposer
from nvcli.engine.step_input import StepInput, build_step_input
from nvcli.engine.structured_output import mask_words
from nvcli.speculative import FLAG

if TYPE_CHECKING:
    from pathlib import Path

    from nvcli.engine.structured_output import GrammarState
    from nvcli.models.model_config import ModelConfig

log = logging.getLogger("nvcli")
PLACEHOLDER = 0  # a draft's token id between propose and fill (a valid id: nothing reads it before fill writes it)
# The largest first forward (tokens) replayed from a graph: a verify step's rows bring 1 or 2 unseen tokens each
GRAPH_TOKENS = 128


def resolve_draft(config: EngineConfig, target: ModelConfig) -> tuple[Path, ModelConfig]:
    """The draft model's directory and config; ConfigError naming the flag where it is missing or its vocabulary is
    not the target's (the drafts are token ids of the target's tokenizer)."""
    from nvcli.models.model_config import load_model_config
    from nvcli.models.resolve import resolve_model

    spec = config.speculative_config
    assert spec is not None and not isinstance(spec, (dict, str)) and spec.model is not None
    try:
        model_dir = resolve_model(spec.model, config.load_format)
        draft = load_model_config(model_dir)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{FLAG}: draft model {spec.model!r}: {e}") from None
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{FLAG}: the draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, the "
                          f"target {target.vocab_size}; a draft must share the target's tokenizer")
    return model_dir, draft


@dataclass
class _DraftState:
    """A sequence's draft KV: tokens [0, valid) computed from its own tokens; the tentative inputs written at
    positions base, base + 1, ... by the last fill (valid there once the sequence keeps the same tokens)."""

    preemptions: int = 0
    valid: int = 0
    base: int = 0
    tentative: tuple[int, ...] = ()

    def sync(self, seq: Sequence) -> int:
        """`valid` as the sequence now is (its verify step collected)."""
        if seq.num_preemptions != self.preemptions:  # its blocks were freed: the draft's KV went with them
            self.preemptions, self.valid, self.tentative = seq.num_preemptions, 0, ()
        kept = kept_drafts(seq.token_ids, self.base, self.tentative)
        if kept:
            self.valid = self.base + kept
        self.tentative = ()
        self.valid = min(self.valid, seq.num_tokens - 1)
        return self.valid


class DraftProposer(Proposer):
    def __init__(self, config: EngineConfig, target: ModelConfig, max_model_len: int, no_draft_at_page_end: bool
                 ) -> None:
        """Loads the draft model (before the target's KV cache is sized, so that on a GPU its weights count as used
        memory); `allocate_cache` follows once the number of blocks is known. `config`: the resolved settings."""
        from nvcli.attention.backend import AttentionBackend
        from nvcli.kernels.shared_prefix_attention import seqs_per_group  # triton: imported on demand
        from nvcli.models.layers.attention import Attention

        spec = config.speculative_config
        assert spec is not None and not isinstance(spec, (dict, str))
        assert config.kvcache_block_size is not None
        super().__init__(spec, max_model_len, config.kvcache_block_size, no_draft_at_page_end)
        model_dir, self.model_config = resolve_draft(config, target)
        self.device = torch.device("cpu") if config.resolved_device() == "cpu" else torch.device("cuda", 0)
        self.dtype = startup.pick_dtype(config, self.device.type)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # rows of a draft forward: the running sequences of a step that speculates
        self.max_rows = min(config.max_num_seqs, spec.disable_by_batch_size)
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.max_positions = self.model_config.max_position_embeddings
        # the draft's own weights as its checkpoint stores them: --quantization applies to the target
        draft_config = dataclasses.replace(config, quantization=None)
        with single_rank():
            self.model = startup.load_model(draft_config, self.model_config, model_dir, self.device, self.dtype)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        layer = self.attn_layers[0]
        log.info("draft model %s: %d layers, hidden %d, k=%d", spec.model, len(self.attn_layers),
                 self.model_config.hidden_size, spec.k)
        width = -(-max_model_len // self.block_size)
        # --batch-invariant as the target's (the model was loaded with it)
        self.attention = AttentionBackend(self.device, self.block_size, width,
                                          seqs_per_group(layer.num_heads, layer.num_kv_heads), config.batch_invariant)
        self.kv_cache: torch.Tensor | None = None
        self.graphs: CudaGraphs | None = None
        self._states: WeakKeyDictionary[Sequence, _DraftState] = WeakKeyDictionary()
        self._catch_up: list[tuple[Sequence, int]] = []  # (sequence, tokens) the next fill processes without drafting

    def allocate_cache(self, num_blocks: int) -> None:
        """The draft's paged KV cache: `num_blocks` blocks (the target's count), bound to its attention layers; on a
        GPU its CUDA graphs are captured then (they read the cache's bindings)."""
        from nvcli.kernels.kv_layout import allocate_kv_cache

        layer = self.attn_layers[0]
        self.kv_cache, caches = allocate_kv_cache(len(self.attn_layers), num_blocks, self.block_size,
                                                  layer.num_kv_heads, layer.head_dim, self.dtype, self.device)
        for attn, kv in zip(self.attn_layers, caches):
            attn.kv = kv
        if self.device.type != "cuda":
            return
        with single_rank():
            if self.use_graphs:
                self.graphs = CudaGraphs(self.model, self.attention, self.device, self.max_rows,
                                         min(GRAPH_TOKENS, self.max_num_batched_tokens), False, 0)
                self.graphs.capture_all(None)
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile at start-up the Triton variants of the draft's eager forwards (a sequence catching up, a first
        forward too big for the graphs) and of its final norm at every row count it samples, which a job's first
        speculating steps would otherwise compile mid-run (the likely cause of a first 8B job with a draft losing
        8.2% where the next lost 0.6%, benchmarks/RESULTS.md)."""
        def forward(step: StepInput) -> None:
            self.model(*eager_inputs(self.attention, self.device, step))

        width = self.attention.max_blocks
        if startup.warm_up_forwards(forward, self.attn_layers[0].kv, self.block_size, width, self.max_model_len):
            for rows in range(1, self.max_rows + 1):
                hidden = torch.zeros(rows, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
                for residual in (hidden, None):  # None: rows of a deferred-norm forward (the residual stream itself)
                    self.model.compute_logits(hidden, residual).argmax(dim=-1)

    def _state(self, seq: Sequence) -> _DraftState:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _DraftState(preemptions=seq.num_preemptions)
        return state

    # ------------------------------------------------------------------ before scheduling
    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        """seq_id -> placeholder drafts (as many as may be verified) for the rows that speculate this step; `fill`
        writes the drafts once the step is scheduled."""
        budget = self.max_num_batched_tokens  # tokens of fill's first forward
        out: dict[int, list[int]] = {}
        self._catch_up = []
        for seq in running:
            # the draft's positions n - 1 .. n + room - 2 stay inside its rotary table
            room = min(self.room(seq), self.max_positions - seq.num_tokens + 1)
            if room < 1 or budget < 1:
                continue
            valid = self._state(seq).sync(seq)
            unseen = seq.num_tokens - valid
            if unseen <= budget:
                out[seq.seq_id] = [PLACEHOLDER] * room
                budget -= unseen
            else:  # tokens the target has computed (their blocks exist), a chunk of them this step
                n = min(budget, seq.num_tokens - 1 - valid)
                self._catch_up.append((seq, n))
                budget -= n
        return out

    # ------------------------------------------------------------------ after scheduling
    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch) -> None:
        """Run the draft for `batch`'s verify rows (and the catching-up chunks) and write their drafts into
        token_ids, where the scheduler put the placeholders."""
        rows: list[tuple[Sequence, int, int]] = []  # (sequence, drafts, n: tokens known before the step)
        for seq, k, index in zip(batch.seqs, batch.num_drafts, batch.sample_index):
            if k:
                rows.append((seq, k, index - k))
        chunks: list[tuple[Sequence, int, int]] = []  # (sequence, first position, tokens) of the first forward
        for seq, _, n in rows:
            state = self._state(seq)
            chunks.append((seq, state.valid, n - state.valid))
        for seq, count in self._catch_up:
            state = self._states.get(seq)
            if seq.status == SequenceStatus.RUNNING and state is not None and state.preemptions == seq.num_preemptions:
                chunks.append((seq, state.valid, count))
                state.valid += count
        self._catch_up = []
        if not chunks:
            return
        # a constrained sequence's drafts follow its grammar: a copy of its matcher runs ahead over them
        cursors = {seq.seq_id: seq.grammar.cursor() for seq, _, _ in rows if seq.grammar is not None}
        with single_rank():
            drafts = self._forward(chunks, len(rows), [cursors.get(seq.seq_id) for seq, _, _ in rows])
            for (seq, _, n), d in zip(rows, drafts):
                seq.token_ids[n] = d
                state = self._state(seq)
                state.valid, state.base = n, n
                if (cursor := cursors.get(seq.seq_id)) is not None:
                    cursor.take(d)
            longest = max((k for _, k, _ in rows), default=0)
            for j in range(1, longest):  # position n + j - 1 takes draft j and predicts draft j + 1
                going = [(seq, n) for seq, k, n in rows if k > j]
                going_cursors = [cursors.get(seq.seq_id) for seq, _ in going]
                out = self._forward([(seq, n + j - 1, 1) for seq, n in going], len(going), going_cursors)
                for (seq, n), d, cursor in zip(going, out, going_cursors):
                    seq.token_ids[n + j] = d
                    if cursor is not None:
                        cursor.take(d)
        for seq, k, n in rows:
            self._state(seq).tentative = tuple(seq.token_ids[n : n + k - 1])
            self.backoff.proposed(seq, n, seq.token_ids[n : n + k])

    def _forward(self, chunks: list[tuple[Sequence, int, int]], num_sampled: int,
                 cursors: list[GrammarState | None] | None = None) -> list[int]:
        """One forward of the draft over `chunks` (sequence, first position, tokens): each computes its tokens'
        KV from token_ids; returns the argmax after the last token of each of the first `num_sampled` chunks, among
        the tokens its grammar cursor allows where it has one."""
        order = sorted(range(len(chunks)), key=lambda i: chunks[i][2] > 1)  # one-token rows first (step_input.py)
        batch = ScheduledBatch([chunks[i][0] for i in order], [chunks[i][2] for i in order],
                               start=[chunks[i][1] for i in order])
        batch.is_decode_only = all(c[2] == 1 for c in chunks)
        step = build_step_input(batch, self.block_size)
        where = {i: r for r, i in enumerate(order)}
        key = self.graphs.key_for(step) if self.graphs is not None else None
        if key is not None:  # the graph's final rows: each sequence's last token, in step order
            hidden, residual = self.graphs.replay(step, key, _no_pending).final  # type: ignore[union-attr]
            last = [where[i] for i in range(num_sampled)]
        else:
            input_ids, positions, meta = eager_inputs(self.attention, self.device, step)
            hidden, residual = self.model(input_ids, positions, meta)
            last = [step.query_start_loc[where[i] + 1] - 1 for i in range(num_sampled)]
        if not num_sampled:
            return []
        index = upload_ints(last, np.int64, self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index),
                                           None if residual is None else residual.index_select(0, index))
        masks = [(i, m) for i, c in enumerate(cursors or ()) if c is not None
                 and (m := c.next_mask(mask_words(logits.shape[1]))) is not None]
        if masks:
            from nvcli.kernels.token_bitmask import apply_token_bitmask_  # Triton: imported when first needed

            apply_token_bitmask_(logits, upload_ints([i for i, _ in masks], np.int64, self.device),
                                 torch.stack([m for _, m in masks]).to(self.device))
        return logits.argmax(dim=-1).tolist()


def _no_pending(input_ids: torch.Tensor) -> None:
    """A draft forward's inputs are all known tokens: nothing to write from a step in flight."""
