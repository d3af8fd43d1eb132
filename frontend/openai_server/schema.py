"""OpenAI request bodies for the HTTP server, and how they map onto our SamplingParams.

Fields we do not implement are still declared when a client might set them, so that a
non-default value is refused with a 400 naming the field instead of being silently ignored.
Unknown fields (metadata, ...) are ignored, as OpenAI's own server does; `user` names the
caller for the engine's fair sharing between clients (client_key.py).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from frontend.openai_server.errors import ApiError, invalid, params_error
from frontend.structured.tool_calls import (
    ToolPlan,
    ToolsError,
    render_tool_calls,
    tool_plan,
    with_tools,
)
from protocol import ChatMessage, SamplingParams, SamplingParamsError
from protocol.client_messages import RequestFieldError
from protocol.sampling_params import (
    MAX_TOKEN_ID,
    MAX_TOP_LOGPROBS,
    check_token_ids,
    choice_params,
)
from protocol.structured_outputs import (
    StructuredOutputs,
    StructuredOutputsError,
    from_response_format,
    structured_from_user,
)
from protocol.template_kwargs import TemplateKwargsError
from protocol.template_kwargs import checked as checked_template_kwargs

MAX_CHOICES = 16
"""Largest `n`: each choice is a request of its own in the engine."""
MAX_BATCH_CHOICES = 1024
"""Most choices of one completions request: its prompts times `n`."""


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
FlagOrNullFalse = Annotated[bool, BeforeValidator(lambda v: False if v is None else v)]
FlagOrNullTrue = Annotated[bool, BeforeValidator(lambda v: True if v is None else v)]
"""OpenAI's booleans are "boolean or null", null meaning the default (clients send None)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: FlagOrNullFalse = False


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
    ignore_eos: FlagOrNullFalse = False
    include_stop_str_in_output: FlagOrNullFalse = False
    skip_special_tokens: FlagOrNullTrue = True
    stream: FlagOrNullFalse = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: Text | None = None
    """OpenAI's end-user id: whose share of the engine the request counts against."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's body field: {"json": schema} | {"regex": ...} | {"choice": [...]} | ..."""

    def _structured(self) -> StructuredOutputs | None:
        """response_format or structured_outputs (not both), checked: a spec xgrammar cannot
        compile is a 400 naming the field it came in."""
        given = from_format = None
        try:
            from_format = from_response_format(self.response_format)
            if self.structured_outputs is not None:
                given = structured_from_user(self.structured_outputs)
        except StructuredOutputsError as exc:
            raise invalid(str(exc), exc.field) from None
        if from_format is not None and given is not None:
            raise invalid("response_format and structured_outputs cannot both constrain the "
                          "output", "structured_outputs")
        return from_format or given

    def constraint_field(self) -> str | None:
        """The body field that constrains the output: an engine error about the constraint
        (one that cannot be completed) names it, as the client wrote it."""
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format"
        return "structured_outputs" if self.structured_outputs is not None else None

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
        """One SamplingParams per choice (protocol.sampling_params.choice_params)."""
        return choice_params(params, self.num_choices)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _params(self, max_tokens: int | None, logprobs: bool, top_logprobs: int = 0,
                structured: StructuredOutputs | None = None) -> SamplingParams:
        """max_tokens None: until the context is full."""
        self._check_unsupported()
        structured = structured or self._structured()
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
                include_stop_str_in_output=self.include_stop_str_in_output,
                stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens, top_logprobs=top_logprobs,
                structured_outputs=structured,
            )
        except SamplingParamsError as exc:
            raise params_error(exc) from None


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    logprobs: bool | int | None = None
    """None/false: none; true or 0: the sampled tokens' logprobs; N: also the N most likely."""
    echo: FlagOrNullFalse = False
    best_of: int | None = None
    suffix: Text | None = None

    def prompt_kwargs(self) -> list[dict[str, Any]]:
        """The client's `prompt=` or `prompt_token_ids=` for each of this request's prompts
        (OpenAI's batch: a list of texts or of token-id lists is several prompts)."""
        prompt = self.prompt
        batch = [prompt] if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and isinstance(prompt[0], int)) else prompt
        if not batch:
            raise invalid("prompt must not be empty", "prompt")
        if len(batch) * self.num_choices > MAX_BATCH_CHOICES:
            raise invalid(f"prompt: {len(batch)} prompts times n={self.num_choices} is more "
                          f"than {MAX_BATCH_CHOICES} choices", "prompt")
        return [self._one_prompt(p, f"prompt[{i}]" if len(batch) > 1 else "prompt")
                for i, p in enumerate(batch)]

    @staticmethod
    def _one_prompt(prompt: str | list[int], where: str) -> dict[str, Any]:
        if isinstance(prompt, str):
            return {"prompt": prompt}
        if not prompt:
            raise invalid(f"{where} must not be empty", "prompt")
        try:
            check_token_ids(where, prompt, RequestFieldError)
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
    content: Text | list[TextPart] | None = Field(None, validate_default=True)
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's calls: written back as the model wrote them (<tool_call> JSON)."""
    tool_call_id: Text | None = None

    @field_validator("content")
    @classmethod
    def _needed_but_for_an_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        """Only an assistant turn may go without content (its tool calls say it all)."""
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content")
        return content

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        content = content or ""
        if self.tool_calls:
            content = "\n".join(c for c in (content, render_tool_calls(self.tool_calls)) if c)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}

    def to_wire(self) -> ChatMessage:
        return ChatMessage(**self.as_dict())


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: FlagOrNullFalse = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: the chat template's extra variables ({"enable_thinking": false})."""

    @property
    def max_tokens_unset(self) -> bool:
        return self.max_tokens is None and self.max_completion_tokens is None

    def template_kwargs(self) -> dict[str, Any] | None:
        try:
            return checked_template_kwargs(self.chat_template_kwargs or {}) or None
        except TemplateKwargsError as exc:
            raise invalid(str(exc), "chat_template_kwargs") from None

    def tool_plan(self) -> ToolPlan | None:
        """What tools and tool_choice ask of the output (None: no tools)."""
        if self.functions:
            raise invalid("functions is not supported; use tools", "functions")
        try:
            return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolsError as exc:
            raise invalid(str(exc), exc.field) from None

    def constraint_field(self) -> str | None:
        """tool_choice when it constrains the output (required or a named function), tools
        when strict tools do under auto."""
        plan = self.tool_plan()
        if plan is not None and plan.structured_outputs() is not None:
            return "tools" if plan.mode == "auto" else "tool_choice"
        return super().constraint_field()

    def wire_messages(self) -> list[ChatMessage]:
        messages = [m.as_dict() for m in self.messages]
        plan = self.tool_plan()
        if plan is not None and plan.mode != "none":
            messages = with_tools(messages, plan.tools)
        return [ChatMessage(**m) for m in messages]

    def sampling_params(self, reasoning: str | None = None) -> SamplingParams:
        """reasoning: the server's reasoning parser, whose block a constraint leaves free."""
        plan = self.tool_plan()
        structured = self._structured()
        if plan is not None and plan.structured_outputs() is not None:
            if structured is not None:
                what, field = ((f"tool_choice {plan.mode}", "tool_choice") if plan.mode != "auto"
                               else ("a strict tool", "tools"))
                raise invalid(f"{what} constrains the output: it cannot be combined with "
                              "response_format or structured_outputs", field)
            try:
                structured = structured_from_user(plan.structured_outputs())
            except StructuredOutputsError as exc:
                raise invalid(f"tools: a function's parameters cannot constrain the output: "
                              f"{exc}", "tools") from None
        if structured is not None and reasoning:
            structured = dataclasses.replace(structured, reasoning=reasoning)
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                "top_logprobs")
        if top and not self.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_completion_tokens is None:
            return self._params(self.max_tokens, self.logprobs, top, structured)
        try:
            return self._params(self.max_completion_tokens, self.logprobs, top, structured)
        except ApiError as exc:  # named as the client named it
            if exc.param != "max_tokens":
                raise
            raise invalid(exc.message.replace("max_tokens", "max_completion_tokens", 1),
                          "max_completion_tokens") from None
