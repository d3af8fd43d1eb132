"""OpenAI request bodies for the HTTP server, and how they map onto our SamplingParams.

Fields we do not implement are still declared when a client might set them, so that a
non-default value is refused with a 400 naming the field instead of being silently ignored.
Unknown fields (user, metadata, ...) are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from protocol import ChatMessage, SamplingParams, SamplingParamsError
from protocol.client_messages import RequestFieldError
from protocol.sampling_params import MAX_TOKEN_ID, MAX_TOP_LOGPROBS, check_token_ids

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - orjson is optional
    import json

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


MAX_CHOICES = 16
"""Largest `n`: each choice is a request of its own in the engine."""
_SEED_MODULUS = 2**63


class ApiError(Exception):
    """An error that reaches the HTTP client as OpenAI's `{"error": {...}}` body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _utf8(text: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800"); no process can encode it as UTF-8."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"not valid Unicode text: a lone surrogate at index {exc.start}"
                             ) from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
"""Every string a request carries into the engine."""
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
"""What the worker's int32 token columns hold (the tokenizer checks the vocabulary)."""


# pydantic puts union-member tags ("str", "list[int]", "TextPart") into error locations.
_LOC_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*|function-.*)$")


def params_error(exc: SamplingParamsError) -> ApiError:
    return invalid(str(exc), exc.field)


_BODY_NAMES = {"prompt_token_ids": "prompt", "client_request_id": None}
"""Engine request fields that the OpenAI body names otherwise (or not at all)."""


def http_param(field: str | None) -> str | None:
    """The body's name of a field the engine names as a GenerateRequest field
    ("params.max_tokens" is `max_tokens`, "prompt_token_ids" is `prompt`)."""
    if field is None:
        return None
    name = field.removeprefix("params.")
    return _BODY_NAMES.get(name, name)


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The first field's pydantic error, with its location written as `messages[0].content`.

    A union (`str | list[TextPart]`) reports one error per member; the one that got deepest
    into the value says most about what is wrong, and among those one whose type matched
    (a value error rather than "should be an integer").
    """
    if not errors:
        return invalid("invalid request body")

    def loc_of(e: dict[str, Any]) -> list[Any]:
        return [p for p in e.get("loc", ()) if not (isinstance(p, str) and _LOC_TAG.match(p))]

    field = loc_of(errors[0])[:2]
    err = max((e for e in errors if loc_of(e)[:2] == field),
              key=lambda e: (len(loc_of(e)), not str(e.get("type", "")).endswith("_type")))
    loc = loc_of(err)
    if loc and loc[0] == "body":
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        return invalid(f"request body is not valid JSON: {err.get('msg', '')}")
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    msg = err.get("msg", "invalid value")
    return invalid(f"{param}: {msg}" if param else msg, param or None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def _check_unsupported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise invalid(f"n must be between 1 and {MAX_CHOICES}, got {self.n}", "n")
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def choice_params(self, params: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per choice; a seeded request seeds choice i with seed + i, so the
        choices differ from each other and the whole response still reproduces."""
        if params.seed is None:
            return [params] * self.num_choices
        return [dataclasses.replace(params, seed=(params.seed + i) % _SEED_MODULUS)
                for i in range(self.num_choices)]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _params(self, max_tokens: int | None, logprobs: bool,
                top_logprobs: int = 0) -> SamplingParams:
        """max_tokens None: until the context is full."""
        self._check_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs["max_tokens"] = max_tokens
        if kwargs.get("top_k") == 0:
            kwargs["top_k"] = -1
        try:
            return SamplingParams(
                **kwargs, ignore_eos=self.ignore_eos, stop=stop,
                stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens, top_logprobs=top_logprobs,
            )
        except SamplingParamsError as exc:
            raise params_error(exc) from None


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    logprobs: bool | int | None = None
    """None/false: none; true or 0: the sampled tokens' logprobs; N: also the N most likely."""
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None

    def prompt_kwargs(self) -> dict[str, Any]:
        """The client's `prompt=` or `prompt_token_ids=` for this request's single prompt."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise invalid("prompt: one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return {"prompt": prompt}
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        try:
            check_token_ids("prompt", prompt, RequestFieldError)
        except RequestFieldError as exc:
            raise invalid(str(exc), "prompt") from None
        return {"prompt_token_ids": list(prompt)}

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise invalid("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise invalid("best_of must be 1 or absent", "best_of")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        lp = self.logprobs
        enabled = lp is not None and lp is not False
        top = 0 if isinstance(lp, bool) or lp is None else lp
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {lp}",
                          "logprobs")
        return self._params(self.max_tokens if self.max_tokens is not None else 16, enabled,
                            top)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: Text


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    def to_wire(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role=role, content=content or "")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def max_tokens_unset(self) -> bool:
        return self.max_tokens is None and self.max_completion_tokens is None

    def wire_messages(self) -> list[ChatMessage]:
        return [m.to_wire() for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        if self.tools or self.functions:
            raise invalid("tools and function calling are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise invalid("tool_choice is not supported", "tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid("only the text response_format is supported", "response_format")
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                "top_logprobs")
        if top and not self.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._params(max_tokens, self.logprobs, top)


# ------------------------------------------------------------------ responses
# Outputs and deltas are the client library's RequestOutput / RequestDelta. The server holds no
# tokenizer, so a logprob's token is named by its id ("token_id:42"), as vLLM does on request.


def _token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


class _Format:
    """One response's id, timestamp and usage, shared by its chunks and choices."""

    prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.prompt_tokens = 0
        self.completion_tokens: dict[int, int] = {}
        """Per choice index: the prompt is counted once, every choice's tokens are added."""

    def _usage(self, out: Any, index: int = 0) -> dict[str, int]:
        # completion_tokens is cumulative in every delta, so the last one seen is the total.
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        previous = self.completion_tokens.get(index, 0)
        self.completion_tokens[index] = out.completion_tokens or previous
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

    def _usage_totals(self) -> dict[str, int]:
        completion = sum(self.completion_tokens.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


class CompletionFormat(_Format):
    @staticmethod
    def _logprobs(out: Any) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        top = None
        if out.top_logprobs is not None:
            top = [{_token_name(t): lp for t, lp in alts} for alts in out.top_logprobs]
        return {"tokens": [_token_name(t) for t in out.token_ids],
                "token_logprobs": list(out.logprobs), "top_logprobs": top, "text_offset": None}

    def _choice(self, index: int, out: Any) -> dict[str, Any]:
        return {"index": index, "text": out.text, "logprobs": self._logprobs(out),
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

    @staticmethod
    def _logprobs(out: Any) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        return {"content": [
            {"token": _token_name(t), "logprob": lp, "bytes": None,
             "top_logprobs": [{"token": _token_name(a), "logprob": alp, "bytes": None}
                              for a, alp in alts]}
            for t, lp, alts in zip(out.token_ids, out.logprobs, tops, strict=True)]}

    def _choice(self, index: int, out: Any) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": out.text},
                "logprobs": self._logprobs(out), "finish_reason": out.finish_reason}

    def start_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                for i in range(num_choices)]

    def delta_chunks(self, delta: Any, index: int = 0) -> list[dict[str, Any]]:
        self._usage(delta, index)
        chunks = []
        if delta.text or delta.token_ids:
            chunks.append(self._chunk({"index": index, "delta": {"content": delta.text},
                                       "logprobs": self._logprobs(delta),
                                       "finish_reason": None}))
        if delta.finish_reason:
            chunks.append(self._chunk({"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": delta.finish_reason}))
        return chunks
