"""OpenAI response bodies and stream chunks, built from the client library's outputs.

Outputs and deltas are the client library's RequestOutput / RequestDelta. A logprob's token
is named by its text, with its UTF-8 `bytes`, as OpenAI does; the detokenizer, which holds
the tokenizer, spells them (a token that is part of a character reads "bytes:\\xe2\\x80").

Usage carries OpenAI's `prompt_tokens_details.cached_tokens` and a `nanopipe` object with the
request's timings (usage_extension), from the metrics on each choice's final output.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Any

from frontend.client.outputs import token_text
from frontend.structured.reasoning import ReasoningSplit, split_reasoning
from frontend.structured.tool_calls import HermesStream, ToolCall, ToolPlan
from protocol.metrics import RequestMetrics


def _spellings(out: Any) -> list[bytes | None]:
    """Each token's bytes; None where the engine sent none (then the id names it)."""
    return list(out.token_bytes) if out.token_bytes is not None else [None] * len(out.token_ids)


def _alt_spellings(out: Any) -> list[list[bytes | None]]:
    if out.top_token_bytes is not None:
        return out.top_token_bytes
    return [[None] * len(alts) for alts in out.top_logprobs or []]


def _token_name(token_id: int, raw: bytes | None = None) -> str:
    return f"token_id:{token_id}" if raw is None else token_text(raw)


def _byte_list(raw: bytes | None) -> list[int] | None:
    return None if raw is None else list(raw)


class _TextOffsets:
    """Where each token's text starts in a choice's text, in characters, across its chunks
    (a token holding part of a character moves the offset only once the character ends)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def of(self, spellings: list[bytes]) -> list[int]:
        offsets = []
        for raw in spellings:
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(raw))
        return offsets


class _Format:
    """One response's id, timestamp and usage, shared by its chunks and choices."""

    prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, include_usage: bool = False,
                 choices_per_prompt: int = 1) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.choices_per_prompt = choices_per_prompt
        """`n`: choice i answers prompt i // n (a completions request may batch prompts)."""
        self.prompt_tokens: dict[int, int] = {}
        """Per prompt: each prompt is counted once, however many choices answer it."""
        self.completion_tokens: dict[int, int] = {}
        """Per choice index: every choice's tokens are added."""
        self.metrics: dict[int, RequestMetrics] = {}
        """Per choice index, from its final output."""

    def _usage(self, out: Any, index: int = 0) -> dict[str, Any]:
        # completion_tokens is cumulative in every delta, so the last one seen is the total.
        prompt = index // self.choices_per_prompt
        self.prompt_tokens[prompt] = out.prompt_tokens or self.prompt_tokens.get(prompt, 0)
        previous = self.completion_tokens.get(index, 0)
        self.completion_tokens[index] = out.completion_tokens or previous
        if out.metrics is not None:
            self.metrics[index] = out.metrics
        return self._usage_totals()

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._head(self.chunk_object)
        chunk["choices"] = [choice]
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def response(self, outs: Sequence[Any]) -> dict[str, Any]:
        """The whole body from each choice's final output, in choice order."""
        body = self._head(self.object)
        body["choices"] = [self._choice(i, out) for i, out in enumerate(outs)]
        for i, out in enumerate(outs):
            self._usage(out, i)
        body["usage"] = self._usage_totals()
        return body

    def _choice(self, index: int, out: Any) -> dict[str, Any]:
        raise NotImplementedError

    def start_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return []

    def end_chunks(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        chunk = self._head(self.chunk_object)
        chunk["choices"] = []
        chunk["usage"] = self._usage_totals()
        return [chunk]

    def _usage_totals(self) -> dict[str, Any]:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.metrics:
            usage.update(usage_extension([self.metrics[i] for i in sorted(self.metrics)],
                                         [i // self.choices_per_prompt
                                          for i in sorted(self.metrics)]))
        return usage


def _timings(m: RequestMetrics) -> dict[str, Any]:
    return {"arrival_time": m.arrival_time, "queue_time_s": m.queue_time_s,
            "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "e2e_s": m.e2e_s,
            "cached_tokens": m.cached_prompt_tokens, "preemptions": m.preemptions,
            "spec_proposed_tokens": m.spec_proposed_tokens,
            "spec_accepted_tokens": m.spec_accepted_tokens}


def usage_extension(metrics: list[RequestMetrics],
                    prompts: list[int] | None = None) -> dict[str, Any]:
    """The usage fields that come from the choices' metrics (in choice order; `prompts`: the
    prompt each answers, all the first by default).

    Each prompt is counted once in usage, so is its cache use: the most any of its choices
    found cached (with n > 1 the choices share the prompt, and all but the first usually
    hit). `nanopipe` holds the first choice's timings, and with several choices every
    choice's in `choices`."""
    prompts = prompts or [0] * len(metrics)
    cached: dict[int, int] = {}
    for m, p in zip(metrics, prompts, strict=True):
        cached[p] = max(cached.get(p, 0), m.cached_prompt_tokens)
    extension = _timings(metrics[0])
    if len(metrics) > 1:
        extension["choices"] = [_timings(m) for m in metrics]
    return {"prompt_tokens_details": {"cached_tokens": sum(cached.values())},
            "nanopipe": extension}


class CompletionFormat(_Format):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, _TextOffsets] = {}
        """Per choice index: its text so far, for text_offset."""

    def _logprobs(self, out: Any, index: int) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        top = None
        if out.top_logprobs is not None:
            top = [{_token_name(t, raw): lp for (t, lp), raw in zip(alts, raws, strict=True)}
                   for alts, raws in zip(out.top_logprobs, _alt_spellings(out), strict=True)]
        spellings = _spellings(out)
        offsets = None
        if out.token_bytes is not None:
            offsets = self._offsets.setdefault(index, _TextOffsets()).of(out.token_bytes)
        return {"tokens": [_token_name(t, raw) for t, raw in zip(out.token_ids, spellings,
                                                                  strict=True)],
                "token_logprobs": list(out.logprobs), "top_logprobs": top,
                "text_offset": offsets}

    def _choice(self, index: int, out: Any) -> dict[str, Any]:
        return {"index": index, "text": out.text, "logprobs": self._logprobs(out, index),
                "finish_reason": out.finish_reason}

    def delta_chunks(self, delta: Any, index: int = 0) -> list[dict[str, Any]]:
        self._usage(delta, index)
        if not (delta.text or delta.token_ids or delta.finish_reason):
            return []
        return [self._chunk(self._choice(index, delta))]


class ChatFormat(_Format):
    prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool = False, choices_per_prompt: int = 1,
                 tools: ToolPlan | None = None, reasoning: str | None = None) -> None:
        super().__init__(model, include_usage, choices_per_prompt)
        self.tools = tools if tools is not None and tools.parses else None
        """How tool calls are read from the text (None: the text is all content)."""
        self.reasoning = reasoning
        """The reasoning parser that splits `reasoning_content` off the text (None: none);
        tool calls are read from the content after it."""
        self._splits: dict[int, ReasoningSplit] = {}
        self._streams: dict[int, HermesStream] = {}
        self._held: dict[int, str] = {}
        """Streaming, per choice: the text of a constrained call, parsed at its end."""
        self._calls: dict[int, int] = {}
        """Streaming, per choice: tool calls sent so far."""

    @staticmethod
    def _logprobs(out: Any) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        alt_raws = _alt_spellings(out) or [[] for _ in out.token_ids]
        return {"content": [
            {"token": _token_name(t, raw), "logprob": lp, "bytes": _byte_list(raw),
             "top_logprobs": [{"token": _token_name(a, a_raw), "logprob": alp,
                               "bytes": _byte_list(a_raw)}
                              for (a, alp), a_raw in zip(alts, a_raws, strict=True)]}
            for t, lp, raw, alts, a_raws in zip(out.token_ids, out.logprobs, _spellings(out),
                                                tops, alt_raws, strict=True)]}

    def _choice(self, index: int, out: Any) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        if self.reasoning is not None:
            message["reasoning_content"], message["content"] = split_reasoning(out.text,
                                                                               self.reasoning)
        finish = out.finish_reason
        if self.tools is not None and message["content"] is not None:
            content, calls = self.tools.parse(message["content"])
            message["content"] = content
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": self._logprobs(out),
                "finish_reason": finish}

    def start_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                for i in range(num_choices)]

    def delta_chunks(self, delta: Any, index: int = 0) -> list[dict[str, Any]]:
        self._usage(delta, index)
        if self.reasoning is None:
            return self._content_chunks(delta, index)
        split = self._splits.setdefault(index, ReasoningSplit(self.reasoning))
        thought, content = split.feed(delta.text or "")
        if delta.finish_reason:
            more_thought, more_content = split.finish()
            thought, content = thought + more_thought, content + more_content
            del self._splits[index]
        if not thought:
            return self._content_chunks(dataclasses.replace(delta, text=content), index)
        # The delta's logprobs go with its content, or with its reasoning when it has none.
        chunks = [self._chunk({"index": index, "delta": {"reasoning_content": thought},
                               "logprobs": None if content else self._logprobs(delta),
                               "finish_reason": None})]
        if not content:
            delta = dataclasses.replace(delta, token_ids=[], logprobs=None, top_logprobs=None,
                                        token_bytes=None, top_token_bytes=None)
        return chunks + self._content_chunks(dataclasses.replace(delta, text=content), index)

    def _content_chunks(self, delta: Any, index: int) -> list[dict[str, Any]]:
        if self.tools is not None:
            return self._tool_chunks(delta, index)
        chunks = []
        if delta.text or delta.token_ids:
            chunks.append(self._chunk({"index": index, "delta": {"content": delta.text},
                                       "logprobs": self._logprobs(delta),
                                       "finish_reason": None}))
        if delta.finish_reason:
            chunks.append(self._chunk({"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": delta.finish_reason}))
        return chunks

    def _tool_chunks(self, delta: Any, index: int) -> list[dict[str, Any]]:
        """Content as it comes, each tool call once it is whole (delta.tool_calls); with a
        constrained tool_choice the text is all one call list, sent at its end."""
        assert self.tools is not None
        content, calls = "", []
        if self.tools.mode == "auto":
            stream = self._streams.setdefault(index, HermesStream())
            content, calls = stream.feed(delta.text or "")
            if delta.finish_reason:
                tail, more = stream.finish()
                content, calls = content + tail, calls + more
        else:
            self._held[index] = self._held.get(index, "") + (delta.text or "")
            if delta.finish_reason:
                text, calls = self.tools.parse(self._held.pop(index))
                content = text or ""
        chunks = []
        if content or (delta.token_ids and delta.logprobs is not None):
            chunks.append(self._chunk({"index": index, "delta": {"content": content},
                                       "logprobs": self._logprobs(delta),
                                       "finish_reason": None}))
        if calls:
            chunks.append(self._chunk({"index": index, "delta": {
                "tool_calls": self._numbered(index, calls)}, "logprobs": None,
                "finish_reason": None}))
        if delta.finish_reason:
            finish = delta.finish_reason
            if self._calls.get(index) and finish == "stop":
                finish = "tool_calls"
            chunks.append(self._chunk({"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": finish}))
        return chunks

    def _numbered(self, index: int, calls: list[ToolCall]) -> list[dict[str, Any]]:
        first = self._calls.get(index, 0)
        self._calls[index] = first + len(calls)
        return [c.to_openai(first + k) for k, c in enumerate(calls)]
