"""Build output lines: native results, OpenAI Batch results, and error lines of both shapes.

Native:  {"id", "text", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"}}
         (+ "token_ids", + "logprobs", + "prompt_logprobs" when asked for); with n > 1 the per-completion fields
         move into "outputs": [{"index", "text", "finish_reason", ...}, ...] and usage counts every completion's
         tokens. "prompt_logprobs" has the logprobs' shape, one entry per prompt token, null for the first.
OpenAI:  {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}
         with body a chat.completion / text_completion object, or {"error": {...}} and
         status_code 400 for a line that cannot be served. "prompt_logprobs" (vLLM's extension: null, then
         {token_id: {"logprob", "rank", "decoded_token"}} per prompt token) sits in each completion choice, and
         at the top of a chat.completion body.
Errors:  {"id", "error": {"type", "message"}} for native lines.
Tools:   a line that offers tools (tool_calls.py) answers with the calls the completion made: a chat message gets
         "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}] ([] when none; content is
         the text before the calls, vLLM's), a native completion keeps its raw "text" and adds "tool_calls";
         finish_reason is "tool_calls" when calls were made (as vLLM answers). Lines without tools are unchanged.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nvcli.jobs.requests import CHAT, NATIVE, LineError, Request
from nvcli.jobs.tool_calls import extract
from nvcli.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class FormatContext:
    model_name: str
    tokenizer: Any = None  # decodes token ids for logprobs; None: tokens shown as ids
    created: int = field(default_factory=lambda: int(time.time()))


def error_line(err: LineError) -> dict[str, Any]:
    line = err.line_no + 1  # 1-based, as editors count
    if err.shape == NATIVE:
        return {"id": err.id, "error": {"type": err.kind, "message": err.message, "line": line}}
    body = {"error": {"message": err.message, "type": "invalid_request_error", "param": None, "code": err.kind,
                      "line": line}}
    return _envelope(err.id, err.custom_id, 400, body)


def result_line(req: Request, out: RequestOutput, ctx: FormatContext) -> dict[str, Any]:
    n_prompt = len(out.prompt_token_ids)
    n_gen = 0 if req.echo_prompt_only else sum(len(c.token_ids) for c in out.outputs)
    k = req.sampling_params.logprobs
    if req.shape == NATIVE:
        line: dict[str, Any] = {"id": req.id}
        completions = [_native_completion(req, comp, ctx) for comp in out.outputs]
        if len(completions) == 1:
            line.update(completions[0])
        else:  # n > 1: one entry per completion, in index order
            line["outputs"] = [{"index": comp.index, **c} for comp, c in zip(out.outputs, completions)]
        if out.prompt_logprobs is not None:
            line["prompt_logprobs"] = [None, *_native_logprobs(out.prompt_token_ids[1:], out.prompt_logprobs[1:],  # type: ignore[arg-type]
                                                               req.sampling_params.prompt_logprobs or 0, ctx)]
        line["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": n_gen}
        return line
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
    choices = []
    for comp in out.outputs:
        want_lp = k is not None and comp.logprobs is not None
        if req.shape == CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": comp.text}
            finish_reason = comp.finish_reason
            if req.tools is not None:
                called = extract(req.tools, comp.text, finish_reason)
                message = {"role": "assistant", "content": called.content, "tool_calls": called.calls}
                finish_reason = called.finish_reason
            choice: dict[str, Any] = {
                "index": comp.index,
                "message": message,
                "logprobs": _chat_logprobs(comp.token_ids, comp.logprobs, k, ctx) if want_lp else None,  # type: ignore[arg-type]
                "finish_reason": finish_reason,
            }
        else:
            choice = _completion_choice(req, out, comp, ctx)
        if req.return_token_ids:
            choice["token_ids"] = list(comp.token_ids)
        if req.shape != CHAT and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_logprobs, ctx)
        choices.append(choice)
    obj, prefix = ("chat.completion", "chatcmpl") if req.shape == CHAT else ("text_completion", "cmpl")
    body = {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": obj,
        "created": ctx.created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage,
    }
    if req.shape == CHAT and out.prompt_logprobs is not None:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_logprobs, ctx)
    return _envelope(req.id, req.custom_id, 200, body)


def _native_completion(req: Request, comp: CompletionOutput, ctx: FormatContext) -> dict[str, Any]:
    """A native line's fields for one completion: text, finish_reason, the tool calls of a line that offers tools,
    and token_ids / logprobs if asked for."""
    out: dict[str, Any] = {"text": comp.text, "finish_reason": comp.finish_reason}
    if req.tools is not None:
        called = extract(req.tools, comp.text, comp.finish_reason)
        out["finish_reason"], out["tool_calls"] = called.finish_reason, called.calls
    if req.return_token_ids:
        out["token_ids"] = list(comp.token_ids)
    k = req.sampling_params.logprobs
    if k is not None and comp.logprobs is not None:
        out["logprobs"] = _native_logprobs(comp.token_ids, comp.logprobs, k, ctx)
    return out


def _envelope(rid: str | int, custom_id: str | None, status: int, body: dict) -> dict[str, Any]:
    return {
        "id": rid,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"nv-batch-{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


def _token_str(tid: int, ctx: FormatContext, lp: Logprob | None = None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token  # the engine decoded it already
    if ctx.tokenizer is None:
        return f"token_id:{tid}"
    return ctx.tokenizer.decode([tid])


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:k] if k > 0 else []


def _lp(entry: dict[int, Logprob], tid: int) -> float | None:
    v = entry.get(tid)
    return None if v is None else float(v.logprob)


def _native_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int, ctx: FormatContext) -> list[dict]:
    out = []
    for tid, entry in zip(token_ids, lps, strict=False):
        item: dict[str, Any] = {"token_id": tid, "token": _token_str(tid, ctx, entry.get(tid)), "logprob": _lp(entry, tid)}
        if k > 0:
            item["top_logprobs"] = [
                {"token_id": t, "token": _token_str(t, ctx, v), "logprob": v.logprob} for t, v in _top(entry, k)
            ]
        out.append(item)
    return out


def _vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None], ctx: FormatContext) -> list[dict | None]:
    """vLLM's OpenAI server shape: per prompt token None or {token_id: {"logprob", "rank", "decoded_token"}}."""
    return [None if entry is None else
            {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": _token_str(t, ctx, v)} for t, v in entry.items()}
            for entry in entries]


def _chat_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int, ctx: FormatContext) -> dict:
    content = []
    for tid, entry in zip(token_ids, lps, strict=False):
        tok = _token_str(tid, ctx, entry.get(tid))
        content.append(
            {
                "token": tok,
                "logprob": _lp(entry, tid),
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": (s := _token_str(t, ctx, v)), "logprob": v.logprob, "bytes": list(s.encode("utf-8"))}
                    for t, v in _top(entry, k)
                ],
            }
        )
    return {"content": content}


def _completion_choice(req: Request, out: RequestOutput, comp: CompletionOutput, ctx: FormatContext) -> dict[str, Any]:
    """A /v1/completions choice. With echo the prompt's text and tokens (the first without a logprob) lead the
    completion's, and with max_tokens 0 stand alone (vLLM's echo)."""
    ids: list[int] = list(comp.token_ids)
    lps: list[dict[int, Logprob] | None] | None = comp.logprobs  # type: ignore[assignment]
    text = comp.text
    if req.echo:
        prompt_text = out.prompt
        if prompt_text is None:  # a token-id prompt
            prompt_text = ctx.tokenizer.decode(out.prompt_token_ids) if ctx.tokenizer is not None else ""
        prompt_lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
        if req.echo_prompt_only:
            ids, lps, text = list(out.prompt_token_ids), prompt_lps, prompt_text
        else:
            ids = list(out.prompt_token_ids) + ids
            lps = prompt_lps + (lps or [None] * len(comp.token_ids))
            text = prompt_text + text
    k = req.sampling_params.logprobs
    return {
        "index": comp.index,
        "text": text,
        "logprobs": _completion_logprobs(ids, lps, k, ctx) if k is not None and lps is not None else None,
        "finish_reason": "length" if req.echo_prompt_only else comp.finish_reason,
    }


def _completion_logprobs(token_ids: list[int], lps: list[dict[int, Logprob] | None], k: int, ctx: FormatContext
                         ) -> dict:
    """OpenAI's legacy logprobs object; a None entry (an echoed prompt's first token) has no logprob."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for tid, entry in zip(token_ids, lps, strict=False):
        tok = _token_str(tid, ctx, None if entry is None else entry.get(tid))
        tokens.append(tok)
        token_lps.append(None if entry is None else _lp(entry, tid))
        tops.append({_token_str(t, ctx, v): v.logprob for t, v in _top(entry, k)} if k > 0 and entry is not None
                    else None)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
