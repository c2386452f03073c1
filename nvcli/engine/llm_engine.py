"""The engine: requests in, one scheduler step at a time, finished outputs out.

`add_request` is safe to call from a producer thread while another thread drives `step()`:
new requests wait in a locked inbox and join the scheduler at the start of the next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nvcli.config import EngineConfig
from nvcli.cpu_threads import set_cpu_threads
from nvcli.engine.admission import Admission, fit_cache, resolve_config
from nvcli.engine.block_manager import BlockManager
from nvcli.engine.detokenizer import IncrementalDetokenizer, find_stop
from nvcli.engine.protocol import EngineStats
from nvcli.engine.scheduler import Scheduler
from nvcli.engine.sequence import Sequence, SequenceStatus
from nvcli.engine.text import TextSide, eos_token_ids, reasoning_markers
from nvcli.outputs import CompletionOutput, RequestOutput
from nvcli.sampling_params import SamplingParams

if TYPE_CHECKING:

    from nvcli.engine.draft_model import DraftProposer
    from nvcli.engine.sampling_stage import StepHandle
    from nvcli.engine.spec_decode import Proposer
    from nvcli.engine.structured_output import GrammarCompiler

log = logging.getLogger("nvcli")


@dataclass
class _Request:
    """One add_request call: its `n` completions (one Sequence each) and what has come back of them.

    With prefix caching, completions 1..n-1 are `held` until completion 0 has computed the prompt, so that they
    find its blocks in the cache instead of computing the same prompt n times in one step."""

    seqs: list[Sequence]
    prompt: str | None
    held: list[Sequence]
    outputs: list[CompletionOutput | None]


class LLMEngine(TextSide):
    def __init__(self, config: EngineConfig) -> None:
        from nvcli.engine.executor import make_executor
        from nvcli.engine.startup import start_compile_workers_if_cold
        from nvcli.models.model_config import load_model_config
        from nvcli.models.resolve import resolve_model
        from nvcli.models.tokenizer import load_tokenizer

        if config.resolved_device() == "cpu":  # before the weights load: conversion runs torch operators too
            set_cpu_threads(config.cpu_threads)
        self.model_dir = resolve_model(config.model, config.load_format)
        self.model_config = load_model_config(self.model_dir)
        explicit_len = config.max_model_len is not None
        self.config = resolve_config(config, self.model_config)
        # A first start-up on a machine compiles its kernels ahead (kernels/compile_ahead.py): its compile workers
        # start here, so that their start and warm-up overlap the tokenizer's load (transformers' imports).
        workers = start_compile_workers_if_cold(self.config, self.model_config)
        spec = self.config.speculative_config
        fp8_pages = str(self.config.kv_cache_dtype).startswith("fp8")
        draft: DraftProposer | None = None
        try:
            if spec is not None and spec.model is not None:  # before the target sizes its cache: see kv_sizing
                from nvcli.engine.draft_model import DraftProposer

                assert self.config.max_model_len is not None  # resolve_config set it
                draft = DraftProposer(self.config, self.model_config, self.config.max_model_len, fp8_pages)
            self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)
            self.reasoning_markers = reasoning_markers(self.tokenizer, config.reasoning_parser)
            self.executor = make_executor(self.config, self.model_config, self.model_dir, compile_workers=workers)
        except BaseException:
            if workers is not None:  # the runner shuts them down once it has compiled; this is for the failures
                workers.shutdown()
            raise
        num_blocks = self.executor.num_kvcache_blocks
        self.config.max_model_len = fit_cache(self.config, num_blocks, explicit_len)
        self.max_model_len = self.config.max_model_len
        self.block_manager = BlockManager(num_blocks, self.config.kvcache_block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_model_len,
            self.config.enable_chunked_prefill,
            self.config.scheduling_policy,
        )
        self.eos_token_ids = eos_token_ids(self.model_dir, self.model_config, self.tokenizer)
        self.admission = Admission(self.config, self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                   self.eos_token_ids, self.reasoning_markers)
        self._inbox: deque[Sequence] = deque()
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._num_held = 0  # completions waiting for their first sibling's prompt (counted as waiting)
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self.num_finished = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_step_time = 0.0
        self.schedule_s = self.execute_s = self.postprocess_s = 0.0
        self.num_decode_steps = 0
        self._request_counter = 0
        self._in_flight = None  # launched step whose tokens are not read yet (async scheduling)
        self._num_constrained = 0  # unfinished sequences with a grammar: steps without any skip the mask hook
        self.async_scheduling = bool(self.config.async_scheduling) and self.executor.supports_async
        self.num_verify_steps = 0
        self.proposer: Proposer | None = draft  # speculative decoding (engine/spec_decode.py, engine/draft_model.py)
        if draft is not None:
            draft.max_model_len = self.max_model_len  # fit_cache may have lowered it
            draft.allocate_cache(num_blocks)
        elif spec is not None:
            from nvcli.engine.spec_decode import NgramProposer

            self.proposer = NgramProposer(spec, self.max_model_len, self.config.kvcache_block_size, fp8_pages)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        prompt_text: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request. `prompt` is text (tokenized here) or token ids; with token ids,
        `prompt_text` is the text they came from (returned as RequestOutput.prompt). `priority` (vLLM's, with
        --scheduling-policy priority): lower is served first, ties by arrival."""
        admitted = self.admission.admit(prompt, sampling_params, prompt_text, priority)
        seqs = admitted.seqs
        request = _Request(seqs, admitted.prompt, seqs[1:] if admitted.hold else [], [None] * len(seqs))
        with self._lock:
            if request_id is None:
                request_id = f"req-{self._request_counter}"
                self._request_counter += 1
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight")
            for seq in seqs:
                seq.request_id = request_id
            self._requests[request_id] = request
            self._num_held += len(request.held)
            self._num_constrained += len(seqs) if admitted.constrained else 0
            self._inbox.extend(seqs[:1] if admitted.hold else seqs)
        return request_id

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """Structured outputs' compiler (engine/structured_output.py); None until a request has a constraint."""
        return self.admission.compiler

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return (bool(self._inbox) or bool(self._aborts) or self.scheduler.has_unfinished()
                    or self._in_flight is not None)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        finished: list[Sequence] = []
        with self._lock:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())
            aborts, self._aborts = self._aborts, set()
        for rid in aborts:
            request = self._requests.get(rid)
            if request is None:
                continue
            for seq in request.seqs:
                if seq in request.held:  # never reached the scheduler
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                    finished.append(seq)
                elif not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    finished.append(seq)
            self._release_held(request)
        drafts = None
        if self.proposer is not None and self.proposer.wants(self.scheduler.running):
            if self._in_flight is not None:  # drafts continue the last tokens: read them first (no overlap here)
                finished.extend(self._collect(self._in_flight))
                self._in_flight = None
            drafts = self.proposer.propose(self.scheduler.running)
        batch = self.scheduler.schedule(drafts)
        if drafts is not None and self.proposer is not None:
            self.proposer.fill(batch)  # a draft model's drafts, now that the step's blocks are allocated
        t1 = time.perf_counter()
        self.schedule_s += t1 - t0
        # The pipeline: launch this step's forward; sample it (a constrained row's mask needs the token before it,
        # so then the step in flight is read first, while the device runs this forward); with async scheduling, read
        # the previous step while the device runs this one; without, read this one.
        handle = None
        if batch.seqs:
            self.prompt_tokens += sum(
                n for s, start, n in zip(batch.seqs, batch.start, batch.num_new_tokens) if start < s.num_prompt_tokens
            )
            self.num_decode_steps += batch.is_decode_only
            handle = self.executor.launch(batch, self._in_flight)
            masks = None
            if self._num_constrained and any(s.grammar is not None for s in batch.seqs):
                if self._in_flight is not None:
                    finished.extend(self._collect(self._in_flight))
                    self._in_flight = None
                compiler = self.admission.compiler
                assert compiler is not None
                masks = compiler.step_mask(batch.seqs, batch.sample_index, batch.num_drafts)
            self.executor.sample(handle, masks)
        verifies = any(batch.num_drafts)
        self.num_verify_steps += verifies
        if not self.async_scheduling or verifies:  # the next step's drafts need what this one accepts
            self._in_flight, handle = handle, None
        if self._in_flight is not None:
            finished.extend(self._collect(self._in_flight))
        self._in_flight = handle
        self.num_steps += 1
        self.last_step_time = time.perf_counter() - t0
        return [out for out in map(self._finish_output, finished) if out is not None]

    def _collect(self, handle: StepHandle) -> list[Sequence]:
        t1 = time.perf_counter()
        result = self.executor.collect(handle)
        t2 = time.perf_counter()
        self.execute_s += t2 - t1
        finished: list[Sequence] = []
        batch = handle.batch
        if result.prompt_logprobs is not None:
            row = 0
            for i, lo, hi in batch.prompt_logit_spans:
                batch.seqs[i].prompt_logprobs.extend_from(result.prompt_logprobs, row, row + hi - lo)  # type: ignore[union-attr]
                row += hi - lo
        logprobs = result.logprobs
        logprob_at = {row: j for j, row in enumerate(result.logprob_rows)}  # batch row -> its position in `logprobs`
        rows = batch.sample_rows() if logprob_at else {}  # seq_id -> where its tokens were sampled
        produced = self.scheduler.postprocess(batch, result.tokens)
        compiler = self.admission.compiler
        for seq, index in produced:
            if seq.is_finished:
                continue  # a verify row's tokens after the one that stopped it (already cut)
            if seq.grammar is not None:  # its matcher takes each kept token, before the stops below read is_done
                compiler.consume(seq.grammar, seq.token_ids[index])  # type: ignore[union-attr]
            self.generation_tokens += 1
            if logprob_at:
                own, first, extra, k = rows[seq.seq_id]
                m = index - first  # a verify row's sample m: m < k at its extra rows, m == k at its own row
                j = logprob_at.get(own if m >= k else extra + m)
                if j is not None:
                    seq.logprobs.append_from(logprobs, j)  # type: ignore[union-attr, arg-type]
            if index == seq.num_prompt_tokens and seq.completion_index == 0:
                self._release_siblings(seq)
            self._check_stop(seq, index)
            if not seq.is_finished and seq.grammar is not None and seq.grammar.is_done:
                seq.constraint_complete = True  # nothing may follow; vLLM would stop at the EOS forced next
                self.scheduler.finish(seq, "stop", None, index)
            if seq.is_finished:
                finished.append(seq)
        self.postprocess_s += time.perf_counter() - t2
        return finished

    def _release_siblings(self, first: Sequence) -> None:
        """The first completion has computed the prompt (its blocks are in the prefix cache now): schedule the rest."""
        request = self._requests.get(first.request_id)
        if request is not None and request.held:
            for seq in request.held:
                self.scheduler.add(seq)
            self._release_held(request)

    def _release_held(self, request: _Request) -> None:
        with self._lock:
            self._num_held -= len(request.held)
            request.held = []

    def _check_stop(self, seq: Sequence, index: int) -> None:
        sp = seq.sampling_params
        if sp.stop:  # stop_list builds a list: only for the requests that have stop strings
            detok = self._detok.get(seq.seq_id)
            if detok is None:
                detok = self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens)
            new = detok.add(seq.token_ids[index])
            if new and index + 1 - seq.num_prompt_tokens >= sp.min_tokens:
                hit = find_stop(detok.text, len(new), sp.stop_list)
                if hit is not None:
                    i, stop = hit
                    seq.stop_text = detok.text[: i + len(stop)] if sp.include_stop_str_in_output else detok.text[:i]
                    self.scheduler.finish(seq, "stop", stop, index)
                    return
        self.scheduler.check_stop(seq, self.eos_token_ids, index)

    def _finish_output(self, seq: Sequence) -> RequestOutput | None:
        """The request's output once its last completion has finished; None while others still run."""
        sp = seq.sampling_params
        self._detok.pop(seq.seq_id, None)
        if seq.grammar is not None:
            with self._lock:
                self._num_constrained -= 1
        ids = seq.completion_token_ids
        text = getattr(seq, "stop_text", None)
        if text is None:
            ids_for_text = ids
            if ids and seq.stop_token_ended and not sp.include_stop_str_in_output:
                ids_for_text = ids[:-1]  # the EOS / stop token itself is not part of the text (vLLM's detokenizer)
            text = self.tokenizer.decode(ids_for_text, skip_special_tokens=sp.skip_special_tokens)
        cum = None
        if seq.logprobs:  # each position's own token comes first
            cum = sum(seq.logprobs.logprobs[lo] for lo in seq.logprobs.starts[:-1])
            seq.logprobs.use_vocabulary(self.token_texts())
        completion = CompletionOutput(
            index=seq.completion_index, text=text, token_ids=ids, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, logprobs=seq.logprobs if sp.logprobs is not None else None,
            cumulative_logprob=cum,
        )
        with self._lock:
            request = self._requests[seq.request_id]
            request.outputs[seq.completion_index] = completion
            if any(out is None for out in request.outputs):
                return None
            del self._requests[seq.request_id]
        self.num_finished += 1
        first = request.seqs[0]
        prompt_logprobs = None
        if sp.prompt_logprobs is not None:
            prompt_logprobs = first.prompt_logprobs  # its first position is empty: nothing predicts the first token
            assert prompt_logprobs is not None
            prompt_logprobs.use_vocabulary(self.token_texts())
        return RequestOutput(
            request_id=seq.request_id, prompt=request.prompt, prompt_token_ids=first.token_ids[: first.num_prompt_tokens],
            outputs=request.outputs, finished=True, num_cached_tokens=first.num_cached_tokens,  # type: ignore[arg-type]
            prompt_logprobs=prompt_logprobs,
        )

    # ------------------------------------------------------------------ introspection
    def reset_prefix_cache(self) -> int:
        """Drop the cached prefixes of finished requests; returns how many blocks were forgotten.
        Call it from the thread that steps the engine (the block manager is not locked)."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._inbox) + self._num_held,
            num_preemptions=self.scheduler.num_preemptions,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            prefix_cache_query_tokens=bm.prefix_query_tokens,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_steps=self.num_steps,
            last_step_time_s=self.last_step_time,
            num_finished=self.num_finished,
            num_chunked_prefills=self.scheduler.num_chunked_prefills,
            schedule_s=self.schedule_s,
            execute_s=self.execute_s,
            postprocess_s=self.postprocess_s,
            num_decode_steps=self.num_decode_steps,
            spec_draft_tokens=self.scheduler.spec_draft_tokens,
            spec_accepted_tokens=self.scheduler.spec_accepted_tokens,
            spec_verify_rows=self.scheduler.spec_verify_rows,
            spec_verify_steps=self.num_verify_steps,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
