"""A fake engine with LLMEngine's interface, for testing the job machinery in milliseconds.

Tokens are characters (id = code point); each step every running request generates one token,
a deterministic function of its prompt, so outputs are checkable; requests finish at
max_tokens, or on the stop token 0 if a prompt contains "!". A running request count above
max_num_seqs waits, so completion order differs from input order. `replies` scripts answers: a
prompt that contains one of its keys generates that key's text, then stops (a model's tool call).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import deque
from pathlib import Path

from nvcli.config import EngineConfig
from nvcli.engine.admission import check_priority
from nvcli.engine.protocol import EngineStats
from nvcli.outputs import CompletionOutput, Logprob, RequestOutput


def jsonl(*objs) -> bytes:
    """An input file's bytes: one JSON line per object (bytes objects go in as they are)."""
    return b"".join((o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs)


class FakeTokenizer:
    name_or_path = ""
    # what tool calling looks for in a template: it renders tools, in Hermes' <tool_call> format
    chat_template = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %} ... <tool_call>"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def engine_stats(**fields) -> EngineStats:
    """EngineStats with `fields`, every other count 0 (and 100 KV blocks)."""
    base = dict(num_running=0, num_waiting=0, num_preemptions=0, kv_blocks_total=100, kv_blocks_used=0,
                prefix_cache_hit_tokens=0, prefix_cache_query_tokens=0, prompt_tokens=0, generation_tokens=0,
                num_steps=0, last_step_time_s=0.0, num_finished=0)
    return EngineStats(**{**base, **fields})


class _Req:
    def __init__(self, rid, prompt, ids, sp, script=None):
        self.rid, self.prompt, self.ids, self.sp = rid, prompt, ids, sp
        self.out: list[int] = []
        self.script: list[int] | None = script  # scripted tokens, then the stop token 0


class FakeEngine:
    """Implements nvcli.engine.protocol.Engine."""

    def __init__(self, max_model_len: int = 200, max_num_seqs: int = 4, step_delay: float = 0.0,
                 replies: dict[str, str] | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.config = EngineConfig(model="fake", device="cpu")
        self.model_dir = Path("fake-model")
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.lock = threading.Lock()
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.st = engine_stats()
        self.added: list[str] = []
        self.sampling_seen: list = []
        self.priorities_seen: list[int] = []
        self.max_unfinished_seen = 0
        self.aborted: list[str] = []
        self.shut = False
        self.encode_batches: list[int] = []  # texts per encode_batch call
        self.replies = dict(replies or {})
        self.rendered: list[str] = []  # every chat rendered, in order

    def render_chat_text(self, messages, chat_template_kwargs=None, tools=None):
        text = "".join(f"<{m['role']}>{m['content']}" + "".join(f"<call>{json.dumps(c['function'])}</call>"
                                                             for c in m.get("tool_calls") or ())
                       for m in messages) + "<assistant>"
        if tools:
            text = f"<tools>{json.dumps(tools)}</tools>" + text
        if chat_template_kwargs and chat_template_kwargs.get("enable_thinking") is False:
            text += "<nothink>"
        self.rendered.append(text)
        return text

    def encode_batch(self, texts, add_special_tokens=True):
        self.encode_batches.append(len(texts))
        return [self.tokenizer.encode(t) for t in texts]

    def add_request(self, prompt, sampling_params, request_id=None, prompt_text=None, priority=0):
        check_priority(priority, self.config.scheduling_policy)  # the engine's own check (admission.py)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        prompt_text = prompt if isinstance(prompt, str) else prompt_text
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        decoded = self.tokenizer.decode(ids)
        script = next((self.tokenizer.encode(reply) + [0] for key, reply in self.replies.items() if key in decoded), None)
        with self.lock:
            self.waiting.append(_Req(request_id, prompt_text, ids, sampling_params, script))
            self.added.append(request_id)
            self.sampling_seen.append(sampling_params)
            self.priorities_seen.append(priority)
            self.max_unfinished_seen = max(self.max_unfinished_seen, len(self.waiting) + len(self.running))
        return request_id

    def has_unfinished(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.aborted.append(request_id)
            self.waiting = deque(r for r in self.waiting if r.rid != request_id)
            self.running = [r for r in self.running if r.rid != request_id]

    def step(self) -> list[RequestOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        with self.lock:
            while self.waiting and len(self.running) < self.max_num_seqs:
                r = self.waiting.popleft()
                self.st.prompt_tokens += len(r.ids)
                self.running.append(r)
            finished = []
            for r in self.running:
                tok = 97 + (sum(r.ids) + 7 * len(r.out)) % 26
                if "!" in (r.prompt or "") and len(r.out) == 2:
                    tok = 0
                if r.script is not None:
                    tok = r.script[len(r.out)]
                r.out.append(tok)
                self.st.generation_tokens += 1
                limit = r.sp.max_tokens if r.sp.max_tokens is not None else self.max_model_len - len(r.ids)
                if tok == 0 and not r.sp.ignore_eos:
                    finished.append((r, "stop"))
                elif len(r.out) >= limit or len(r.ids) + len(r.out) >= self.max_model_len:
                    finished.append((r, "length"))
            outs = []
            for r, reason in finished:
                self.running.remove(r)
                toks = r.out[:-1] if reason == "stop" else r.out
                lps = ([{t: Logprob(-0.5, 1), 98: Logprob(-1.5, 2)} if t != 98 else {t: Logprob(-0.5, 1), 99: Logprob(-1.5, 2)}
                        for t in r.out] if r.sp.logprobs is not None else None)
                outs.append(RequestOutput(
                    request_id=r.rid, prompt=r.prompt, prompt_token_ids=r.ids,
                    outputs=[CompletionOutput(0, self.tokenizer.decode(toks), r.out, reason, None, lps)],
                    finished=True,
                ))
            self.st.num_steps += 1
            self.st.num_finished += len(outs)
            self.st.num_running = len(self.running)
            self.st.num_waiting = len(self.waiting)
            return outs

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.st)

    def token_texts(self) -> list[str]:
        return [chr(i) for i in range(0x3000)]

    def shutdown(self) -> None:
        self.shut = True
