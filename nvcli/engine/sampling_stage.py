"""Rank 0's sampling stage: a step's logits -> its tokens (and logprobs), copied to the host behind one event.

What a step samples with is data: SamplingInputs, built from the scheduler's batch on the engine's side before the
step is launched. The stage owns what lives on the device across steps: the RNG, the penalized sequences' token
history (engine/penalties.py), the sampler graphs of small decode steps (engine/sampler_graphs.py) and the stream
that uploads structured outputs' token masks.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from nvcli.engine.penalties import PenaltySlots
from nvcli.engine.sampler import (
    RowValues,
    SamplingBatch,
    TokenLogprobs,
    logprob_rows,
    sample,
    sampled_token_logprobs,
    token_logprobs,
)
from nvcli.engine.sampler_graphs import SamplerGraphs
from nvcli.engine.scheduler import ScheduledBatch
from nvcli.outputs import FlatLogprobs
from nvcli.sampling_params import SamplingParams
from nvcli.uploads import upload

# structured outputs: (rows, their token bitmask [len(rows), ceil(vocab / 32)] int32) that restrict those rows' tokens
TokenMasks = tuple[list[int], torch.Tensor]


@dataclass
class SamplingInputs:
    """Everything rank 0 samples a step with, per batch row, built by the engine from the scheduled batch."""

    batch: ScheduledBatch  # its sequences hold the penalized rows' token history (PenaltySlots)
    params: list[SamplingParams]
    positions: list[int]  # each row's output position (0 while it computes its prompt)
    banned: list[tuple[int, tuple[int, ...]]]  # (row, token ids) that min_tokens keeps out for now
    logprob_rows: list[int]  # the rows that asked for logprobs, and each one's alternatives
    logprob_ks: list[int]
    prompt_targets: list[int]  # the prompt token each position of the batch's prompt_logit_spans predicts
    prompt_ks: list[int]  # each span's alternatives
    row_of: dict[int, int]  # seq_id -> row, for the next step's pending inputs
    logit_bias: bool  # some row has a logit_bias

    @staticmethod
    def of(batch: ScheduledBatch) -> SamplingInputs:
        row_seqs = list(batch.seqs)  # each row's sequence
        positions = [max(0, i - s.num_prompt_tokens) for s, i in zip(batch.seqs, batch.sample_index)]
        # A verify sequence's rows before its last (speculative decoding): after every sequence's own row, each with
        # its parameters and its own output position (its last row samples the position after them). A min_tokens
        # ban holds at each of them by that row's own position, as plain decoding would ban there; penalties read
        # each row's own history, the sequence's plus the drafts before the row (PenaltySlots.prepare). A row asking
        # for logprobs gets them at every one of its rows (logprob_rows below), each from that position's logits,
        # and the engine files each kept token's under its position (ScheduledBatch.sample_rows).
        for s, index, k in zip(batch.seqs, batch.sample_index, batch.num_drafts):
            if k:
                row_seqs.extend([s] * k)
                positions.extend(range(index - k - s.num_prompt_tokens, index - s.num_prompt_tokens))
        params = [s.sampling_params for s in row_seqs]
        banned = [(row, s.min_tokens_banned) for row, (s, pos) in enumerate(zip(row_seqs, positions))
                  if s.min_tokens_banned and pos < s.sampling_params.min_tokens]
        rows, ks = logprob_rows([p.logprobs for p in params])
        targets: list[int] = []
        span_ks: list[int] = []
        for i, lo, hi in batch.prompt_logit_spans:
            seq = batch.seqs[i]
            targets.extend(seq.token_ids[lo + 1 : hi + 1])
            span_ks.append(seq.sampling_params.prompt_logprobs or 0)
        return SamplingInputs(batch, params, positions, banned, rows, ks, targets, span_ks,
                              {s.seq_id: i for i, s in enumerate(batch.seqs)}, any(p.logit_bias for p in params))


@dataclass
class StepHandle:
    """A launched step: sampled tokens on the device, copied to pinned host memory (with the logprobs asked for)
    behind an event."""

    inputs: SamplingInputs
    logits: torch.Tensor | None  # [num_seqs, vocab] until sampled
    prompt_rows: Iterable[torch.Tensor] | None  # logits chunks of the prompt_logprobs rows, until sampled
    prompt_rows_n: int  # rows in prompt_rows (whole chunks: padded past the targets with the last one)
    graph_rows: int  # the sampler graphs' size that may sample this step (0: none)
    tokens: torch.Tensor | None = None  # [num_seqs] int64 on the device
    tokens_host: torch.Tensor | None = None  # [num_seqs] int64, pinned (or the CPU tensor itself)
    done: torch.cuda.Event | None = None
    logprobs: TokenLogprobs | None = None  # of logprob_rows, in order; on the host once `done`
    prompt_logprobs: TokenLogprobs | None = None  # of the batch's prompt_logit_spans, in order

    @property
    def batch(self) -> ScheduledBatch:
        return self.inputs.batch

    @property
    def row_of(self) -> dict[int, int]:
        return self.inputs.row_of


@dataclass
class StepResult:
    """What a collected step hands the engine."""

    tokens: list[int]  # per batch row
    logprobs: FlatLogprobs | None  # of the rows that asked (logprob_rows), one position each
    logprob_rows: list[int]
    prompt_logprobs: FlatLogprobs | None  # the rows of the batch's prompt_logit_spans, one after another


class SamplingStage:
    def __init__(self, device: torch.device, seed: int, broadcast_tokens: bool) -> None:
        """`broadcast_tokens`: tensor-parallel ranks feed pending inputs from rank 0's tokens (async scheduling)."""
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.noise_rng = random.Random(seed)  # per-step noise seeds of unseeded rows (GPU sampler)
        self.penalty_slots = PenaltySlots(device)
        self.sampler_graphs: SamplerGraphs | None = None  # set once the decode graphs are captured
        self.broadcast_tokens = broadcast_tokens
        self._mask_stream: torch.cuda.Stream | None = None

    @torch.inference_mode()
    def sample(self, handle: StepHandle, masks: TokenMasks | None = None) -> torch.Tensor:
        """Sample a launched step (enqueued, no host sync) -> its tokens on the device. `masks` restrict rows' tokens
        in place: the logprobs are then those of the constrained distribution, as in vLLM."""
        logits, inputs = handle.logits, handle.inputs
        assert logits is not None
        if masks is not None:
            from nvcli.kernels.token_bitmask import apply_token_bitmask_  # Triton: imported when first needed

            rows, bitmask = masks
            apply_token_bitmask_(logits, *self._upload_token_mask(rows, bitmask))
        vocab = logits.shape[1]
        batch = inputs.batch
        penalties = self.penalty_slots.prepare(batch.seqs, batch.sample_index, vocab, batch.num_drafts)
        if (handle.graph_rows and self.sampler_graphs is not None and masks is None and penalties is None
                and not inputs.banned and not inputs.logit_bias):
            values = RowValues.of(inputs.params, inputs.positions, vocab, self.noise_rng)
            tokens = self.sampler_graphs.sample(handle.graph_rows, values)[: len(inputs.params)]
        else:
            sb = SamplingBatch.build(inputs.params, inputs.positions, vocab, self.device,
                                     self.noise_rng if self.device.type == "cuda" else None, inputs.banned, penalties)
            tokens = sample(logits, sb, self.generator)
        if penalties is not None:
            self.penalty_slots.record(penalties, tokens)
        if self.broadcast_tokens:
            torch.distributed.broadcast(tokens, src=0)
        handle.logprobs = sampled_token_logprobs(logits, tokens, inputs.logprob_rows, inputs.logprob_ks)
        if handle.prompt_rows is not None:
            targets = inputs.prompt_targets
            targets = targets + targets[-1:] * (handle.prompt_rows_n - len(targets))  # the padding rows
            handle.prompt_logprobs = token_logprobs(handle.prompt_rows, targets, max(inputs.prompt_ks), self.device)
        handle.tokens, handle.logits, handle.prompt_rows = tokens, None, None
        if self.device.type == "cuda":  # one event behind every copy: collect reads them all after it
            handle.tokens_host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            handle.tokens_host.copy_(tokens, non_blocking=True)
            handle.logprobs = None if handle.logprobs is None else handle.logprobs.to_host()
            handle.prompt_logprobs = None if handle.prompt_logprobs is None else handle.prompt_logprobs.to_host()
            handle.done = torch.cuda.Event()
            handle.done.record()
        else:
            handle.tokens_host = tokens
        return tokens

    def _upload_token_mask(self, rows: list[int], bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows and their bitmask on the device. On a GPU the copy (19 KB a row: 4.9 MB at 256 rows) goes on a
        stream of its own, so that it overlaps the forward still running instead of waiting behind it on the
        step's stream; the mask kernel waits for it (H100: +0.5 ms per step with it in line)."""
        rows_host = torch.tensor(rows, dtype=torch.int64)
        if self.device.type != "cuda":
            return rows_host, bitmask
        if self._mask_stream is None:
            self._mask_stream = torch.cuda.Stream(self.device)
        step_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._mask_stream):
            rows_dev, mask_dev = upload(rows_host, self.device), upload(bitmask, self.device)
        step_stream.wait_stream(self._mask_stream)
        rows_dev.record_stream(step_stream)  # allocated on the copy stream, read on the step's
        mask_dev.record_stream(step_stream)
        return rows_dev, mask_dev


def collect(handle: StepHandle) -> StepResult:
    """Wait for a sampled step; its tokens (and logprobs where asked)."""
    if handle.done is not None:
        handle.done.synchronize()
    assert handle.tokens_host is not None, "collect before sample"
    inputs = handle.inputs
    logprobs = None if handle.logprobs is None else handle.logprobs.flat(inputs.logprob_ks)
    prompt_logprobs = None
    if handle.prompt_logprobs is not None:
        spans = inputs.batch.prompt_logit_spans
        prompt_logprobs = handle.prompt_logprobs.flat(np.repeat(inputs.prompt_ks, [hi - lo for _, lo, hi in spans]))
    return StepResult(handle.tokens_host.tolist(), logprobs, inputs.logprob_rows, prompt_logprobs)
