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
Reasoning: with --reasoning-parser, a chat line's text is split where the reasoning ends (reasoning.py): a chat
         message gets "reasoning" (vLLM's field; null when there was none) and the answer as its content, a native
         line the answer as "text" ("" when there was none) and "reasoning"; tool calls are read from the answer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NamedTuple

from nvcli.jobs.jsonio import orjson
from nvcli.jobs.logprobs_json import native_positions, vllm_positions
from nvcli.jobs.requests import CHAT, NATIVE, LineError, Request
from nvcli.jobs.tool_calls import extract
from nvcli.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from nvcli.reasoning import ReasoningSplit, split_reasoning


@dataclass
class FormatContext:
    model_name: str
    tokenizer: Any = None  # decodes token ids for logprobs; None: tokens shown as ids
    reasoning_parser: str | None = None  # --reasoning-parser: chat lines' reasoning is split from their content
    created: int = field(default_factory=lambda: int(time.time()))
    # every token id's text alone, by id: the engine's (LLMEngine.token_texts), which a job gives its formatting
    # processes, since a pickled copy of the engine's logprobs leaves it behind; without it, `tokenizer` decodes
    # each entry's token on its own
    vocabulary: list[str] | None = field(default=None, repr=False)
    # the line is written by jsonio.dumps (orjson): a scoring line's logprob list may go into it already serialized,
    # as an orjson.Fragment (jobs/logprobs_json.py); a dict for other readers holds plain values only
    raw_json: bool = False


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
            line["prompt_logprobs"] = _native_list(out.prompt_token_ids[1:], out.prompt_logprobs,
                                                   req.sampling_params.prompt_logprobs or 0, ctx, first=1)
        line["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": n_gen}
        return line
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
    choices = []
    # vLLM's prompt_logprobs: one list for every choice (a 1,000-token prompt's costs more to build than the rest)
    prompt_lps = None if out.prompt_logprobs is None else _vllm_prompt_logprobs(out.prompt_logprobs, ctx)
    for comp in out.outputs:
        want_lp = k is not None and comp.logprobs is not None
        if req.shape == CHAT:
            thought = _reasoning(req, comp.text, ctx)
            content = comp.text if thought is None else thought.content
            message: dict[str, Any] = {"role": "assistant", "content": content}
            finish_reason = comp.finish_reason
            if req.tools is not None:
                called = extract(req.tools, content or "", finish_reason)
                message = {"role": "assistant", "content": called.content, "tool_calls": called.calls}
                finish_reason = called.finish_reason
            if thought is not None:
                message["reasoning"] = thought.reasoning
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
        if req.shape != CHAT and prompt_lps is not None:
            choice["prompt_logprobs"] = prompt_lps
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
    if req.shape == CHAT and prompt_lps is not None:
        body["prompt_logprobs"] = prompt_lps
    return _envelope(req.id, req.custom_id, 200, body)


def _native_completion(req: Request, comp: CompletionOutput, ctx: FormatContext) -> dict[str, Any]:
    """A native line's fields for one completion: text, finish_reason, the tool calls of a line that offers tools,
    and token_ids / logprobs if asked for."""
    out: dict[str, Any] = {"text": comp.text, "finish_reason": comp.finish_reason}
    thought = _reasoning(req, comp.text, ctx)
    if thought is not None:
        out["text"], out["reasoning"] = thought.content or "", thought.reasoning
    if req.tools is not None:
        called = extract(req.tools, out["text"], comp.finish_reason)
        out["finish_reason"], out["tool_calls"] = called.finish_reason, called.calls
    if req.return_token_ids:
        out["token_ids"] = list(comp.token_ids)
    k = req.sampling_params.logprobs
    if k is not None and comp.logprobs is not None:
        out["logprobs"] = _native_list(comp.token_ids, comp.logprobs, k, ctx)
    return out


def _reasoning(req: Request, text: str, ctx: FormatContext) -> ReasoningSplit | None:
    """A chat line's reasoning and content under --reasoning-parser (vLLM splits chat completions only); else None."""
    if ctx.reasoning_parser is None or req.messages is None:
        return None
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False
    return split_reasoning(ctx.reasoning_parser, text, thinking)


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


# Logprobs are formatted from flat columns (outputs.FlatLogprobs, as the engine hands prompt logprobs): a scoring job
# writes millions of positions, and building a dict of Logprob objects per position first cost more than the rest
# of the line. A position is the run starts[i]:starts[i + 1]: its own token first, then the alternatives. The columns
# are read whole (a list comprehension per field, not a loop over positions): an lm-eval line of 1,000 echoed tokens
# took 2.4 ms to format position by position, on the thread that shares the GIL with the engine's step loop.


class _Columns(NamedTuple):
    """Per token of a part: its text, its logprob (None where its position has none: an echoed prompt's first token)
    and its position's k most likely entries (indices into `flat`), most likely first; `tops` is None for k <= 0."""

    flat: FlatLogprobs
    entry_texts: list[str]  # per entry of `flat`
    own: list[int | None]  # per token: its own entry in `flat`, None where its position lacks it
    texts: list[str]
    logprobs: list[float | None]
    tops: list[list[int]] | None


def _flat(lps: Sequence[dict[int, Logprob] | None]) -> FlatLogprobs:
    """The engine's FlatLogprobs as they are; a list of dicts (a completion's logprobs) made into one."""
    return lps if isinstance(lps, FlatLogprobs) else FlatLogprobs.from_entries(lps)


def _attach_vocabulary(flat: FlatLogprobs, ctx: FormatContext) -> None:
    if flat.wants_vocabulary and ctx.vocabulary is not None and flat.max_token_id() < len(ctx.vocabulary):
        flat.use_vocabulary(ctx.vocabulary)  # a pickled copy of the engine's logprobs: they left its vocabulary behind


def _texts(flat: FlatLogprobs, ctx: FormatContext) -> list[str]:
    _attach_vocabulary(flat, ctx)
    texts = flat.decoded_tokens
    if texts is None or None in texts:
        texts = [_token_str(t, ctx) if texts is None or texts[j] is None else texts[j]  # type: ignore[misc]
                 for j, t in enumerate(flat.token_ids)]
    return texts  # type: ignore[return-value]


def _columns(token_ids: Sequence[int], lps: Sequence[dict[int, Logprob] | None], k: int, ctx: FormatContext,
             first: int = 0) -> _Columns:
    """The tokens' columns, `token_ids[i]` at the logprobs' position first + i. A token's own entry is the first of
    its position (the engine's order), else found in the run, else there is none (logprob None, no top entries).
    Top entries: the most likely first, ties in the position's order, the token itself among them where it is one."""
    flat = _flat(lps)
    entry_texts, ids, values = _texts(flat, ctx), flat.token_ids, flat.logprobs
    los = flat.starts[first : first + len(token_ids)]
    his = flat.starts[first + 1 : first + len(token_ids) + 1]
    own: list[int | None] = [lo if lo < hi and ids[lo] == t else None for t, lo, hi in zip(token_ids, los, his)]
    if None in own:
        own = [j if j is not None else next((e for e in range(lo, hi) if ids[e] == t), None)
               for j, t, lo, hi in zip(own, token_ids, los, his)]
        texts = [entry_texts[j] if j is not None else _token_str(t, ctx) for j, t in zip(own, token_ids)]
        logprobs: list[float | None] = [None if j is None else values[j] for j in own]
    else:
        texts = [entry_texts[j] for j in own]  # type: ignore[index]
        logprobs = [values[j] for j in own]  # type: ignore[index]
    tops = None
    if k > 0:
        tops = [[] if j is None else [lo] if hi - lo == 1 or (k == 1 and hi - lo == 2 and values[lo] >= values[lo + 1])
                else [lo + 1] if k == 1 and hi - lo == 2
                else sorted(range(lo, hi), key=values.__getitem__, reverse=True)[:k]
                for j, lo, hi in zip(own, los, his)]
    return _Columns(flat, entry_texts, own, texts, logprobs, tops)


def _native_list(token_ids: Sequence[int], lps: Sequence[dict[int, Logprob] | None], k: int, ctx: FormatContext,
                 first: int = 0) -> list[dict | None] | Any:
    """A native line's logprobs (`first` = 0) or prompt_logprobs (`first` = 1: null for the prompt's first token,
    then position i for token i): where ctx.raw_json allows, the engine's columns as one orjson.Fragment
    (logprobs_json.native_positions), else _native_logprobs' dicts."""
    if ctx.raw_json and isinstance(lps, FlatLogprobs):
        _attach_vocabulary(lps, ctx)
        raw = native_positions(lps, token_ids, k, first)
        if raw is not None:
            items = [b"null"] * first + ([raw] if raw else [])
            return orjson.Fragment(b"[" + b",".join(items) + b"]")
    return [None] * first + _native_logprobs(token_ids, lps, k, ctx, first)


def _native_logprobs(token_ids: Sequence[int], lps: Sequence[dict[int, Logprob] | None], k: int, ctx: FormatContext,
                     first: int = 0) -> list[dict]:
    c = _columns(token_ids, lps, k, ctx, first)
    if c.tops is None:
        return [{"token_id": t, "token": s, "logprob": v} for t, s, v in zip(token_ids, c.texts, c.logprobs)]
    # every entry's object once (an entry is among its position's top ones at most once)
    entries = [{"token_id": i, "token": s, "logprob": v}
               for i, s, v in zip(c.flat.token_ids, c.entry_texts, c.flat.logprobs)]
    return [{"token_id": t, "token": s, "logprob": v, "top_logprobs": list(map(entries.__getitem__, top))}
            for t, s, v, top in zip(token_ids, c.texts, c.logprobs, c.tops)]


def _vllm_prompt_logprobs(lps: Sequence[dict[int, Logprob] | None], ctx: FormatContext) -> list[dict | None] | Any:
    """vLLM's OpenAI server shape: per prompt token None or {token_id: {"logprob", "rank", "decoded_token"}}."""
    flat = _flat(lps)
    if ctx.raw_json:
        _attach_vocabulary(flat, ctx)
        raw = vllm_positions(flat)
        if raw is not None:
            return orjson.Fragment(b"[" + raw + b"]")
    starts, keys = flat.starts, list(map(str, flat.token_ids))
    entries = [{"logprob": v, "rank": r, "decoded_token": t}
               for v, r, t in zip(flat.logprobs, flat.ranks, _texts(flat, ctx))]
    return [dict(zip(keys[lo:hi], entries[lo:hi])) if lo < hi else None for lo, hi in zip(starts, starts[1:])]


def _chat_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int, ctx: FormatContext) -> dict:
    c = _columns(token_ids, lps, k, ctx)
    texts, values = c.entry_texts, c.flat.logprobs
    tops = c.tops if c.tops is not None else [[]] * len(c.texts)
    return {"content": [{"token": s, "logprob": v, "bytes": list(s.encode("utf-8")),
                         "top_logprobs": [{"token": texts[j], "logprob": values[j],
                                           "bytes": list(texts[j].encode("utf-8"))} for j in top]}
                        for s, v, top in zip(c.texts, c.logprobs, tops)]}


def _completion_choice(req: Request, out: RequestOutput, comp: CompletionOutput, ctx: FormatContext) -> dict[str, Any]:
    """A /v1/completions choice. With echo the prompt's text and tokens (the first without a logprob) lead the
    completion's, and with max_tokens 0 stand alone (vLLM's echo)."""
    k = req.sampling_params.logprobs
    parts: list[tuple[Sequence[int], Sequence[dict[int, Logprob] | None] | None]] = [(comp.token_ids, comp.logprobs)]
    text = comp.text
    if req.echo:
        prompt_text = out.prompt
        if prompt_text is None:  # a token-id prompt, or one cut by truncate_prompt_tokens: its tokens' text
            prompt_text = ctx.tokenizer.decode(out.prompt_token_ids) if ctx.tokenizer is not None else ""
        prompt = (out.prompt_token_ids, out.prompt_logprobs)
        parts, text = ([prompt], prompt_text) if req.echo_prompt_only else ([prompt, *parts], prompt_text + text)
    return {
        "index": comp.index,
        "text": text,
        "logprobs": _completion_logprobs(parts, k, ctx) if k is not None and parts[-1][1] is not None else None,
        "finish_reason": "length" if req.echo_prompt_only else comp.finish_reason,
    }


def _others(values: Sequence[float], own: int, lo: int, hi: int) -> list[int]:
    """The entries lo..hi-1 of a position other than its token's own (`own`), most likely first, ties in their order
    (the engine's alternatives come so already)."""
    others = [e for e in range(lo, hi) if e != own]
    if all(values[a] >= values[b] for a, b in zip(others, others[1:])):
        return others
    return sorted(others, key=values.__getitem__, reverse=True)


def _completion_logprobs(parts: list[tuple[Sequence[int], Sequence[dict[int, Logprob] | None] | None]], k: int,
                         ctx: FormatContext) -> dict:
    """OpenAI's legacy logprobs object over the parts' tokens in turn (an echoed prompt, then the completion); a token
    without a logprob (the prompt's first, or a part without logprobs) has null there, in token_logprobs and
    top_logprobs alike (vLLM's serving_completion.py). A token's top_logprobs is vLLM's: the token itself, then its
    position's k most likely other entries, so k + 1 entries where the token is not among the k most likely (OpenAI:
    "up to logprobs+1 elements"); with k = 0 the token alone."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for token_ids, lps in parts:
        if lps is None:
            tokens += [_token_str(t, ctx) for t in token_ids]
            token_lps += [None] * len(token_ids)
            tops += [None] * len(token_ids)
            continue
        c = _columns(token_ids, lps, 0, ctx)
        tokens += c.texts
        token_lps += c.logprobs
        texts, values, starts = c.entry_texts, c.flat.logprobs, c.flat.starts
        tops += [None if j is None else {texts[j]: values[j]} if k <= 0 or hi - lo == 1
                 else {texts[e]: values[e] for e in (j, *_others(values, j, lo, hi)[:k])}
                 for j, lo, hi in zip(c.own, starts, starts[1:])]
    offsets = list(accumulate(map(len, tokens), initial=0))[:-1]
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
