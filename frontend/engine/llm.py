"""The offline API: generate for a list of prompts, or chat, through a full pipeline."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from frontend.actors.request_validation import CHAT_ROLES
from frontend.client.async_client import AsyncClient
from frontend.client.chat_input import as_chat_message
from frontend.engine.config import ENGINE_FIELDS, EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.engine.prompt_input import as_requests
from frontend.structured.tool_calls import ToolPlan, ToolsError, tool_plan, with_tools
from protocol import SamplingParams
from protocol.sampling_params import as_sampling_params, choice_params

log = logging.getLogger("nanopipe.llm")

Prompt = str | list[int] | Mapping[str, Any]
"""A text, token ids, or {"prompt": text} / {"prompt_token_ids": ids} (see prompt_input)."""
Message = Mapping[str, Any]
"""{"role": ..., "content": ...}; content is a string or a list of {"type": "text"} parts."""
Conversation = Sequence[Message]


class LLM:
    """`LLM(model).generate(prompts, params)`, with the same processes as a served pipeline."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """`options` are EngineConfig's fields (tensor_parallel_size, device, dtype,
        max_model_len, ...), with its defaults: the same settings as `nanopipe serve`'s flags,
        except that no stats lines are logged unless `log_stats_interval` is given (a
        progress bar already reports an offline run)."""
        unknown = sorted(options.keys() - ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"LLM got unknown options {unknown}; the options are EngineConfig's "
                            f"fields: {', '.join(sorted(ENGINE_FIELDS - {'model'}))}")
        options.setdefault("log_stats_interval", 0.0)
        self.config = EngineConfig(model=model, **options)
        self.pipeline = Pipeline(self.config)
        self.pipeline.start()
        if self.pipeline.startup is not None:
            log.info("nanopipe: %s", self.pipeline.startup.line())
        # Stops the processes when this LLM is garbage collected or the interpreter exits,
        # so a script that never calls close() still exits promptly and cleanly.
        self._finalizer = weakref.finalize(self, self.pipeline.stop)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process of the engine (also done at exit if never called)."""
        self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed: its engine has stopped; make a new LLM")

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Results in input order: [{"text", "token_ids", "finish_reason", "metrics"}, ...]
        ("metrics": a RequestMetrics), with "logprobs" (and "top_logprobs": per token
        [(id, logprob)] best first) when asked for."""
        self._check_open()
        requests = as_requests(prompts)
        params = _params_per_request(sampling_params, len(requests), "prompt")
        return _run(self._generate(requests, params, use_tqdm))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[dict[str, Any]]:
        """Reply to one conversation (a list of {"role", "content"} dicts) or to a list of
        conversations, after the model's chat template with its generation prompt. Results
        in input order, the same dicts as `generate` returns.

        The tokenizer process applies the template, as it does for a client's `messages`;
        with `chat_template_kwargs` (e.g. {"enable_thinking": False}) or without the
        generation prompt it is applied here and the pipeline gets the token ids.

        `tools`, `tool_choice` and `parallel_tool_calls` as OpenAI's
        (frontend.structured.tool_calls): the tools go into the system prompt, "required" or a
        named function constrain the answer, and each result gets `tool_calls` (OpenAI's
        dicts) and `content` parsed from its text.
        """
        self._check_open()
        try:
            plan = tool_plan(tools, tool_choice, parallel_tool_calls)
        except ToolsError as exc:
            raise ValueError(str(exc)) from None
        conversations = _as_conversations(messages)
        if plan is not None and plan.mode != "none":
            conversations = [with_tools(c, plan.tools) for c in conversations]
        template_kwargs = dict(chat_template_kwargs or {})
        if not add_generation_prompt:
            template_kwargs["add_generation_prompt"] = False
        if template_kwargs:
            requests = [{"prompt_token_ids": self._chat_prompt_ids(c, template_kwargs)}
                        for c in conversations]
        else:
            requests = [{"messages": c} for c in conversations]
        params = _params_per_request(sampling_params, len(requests), "conversation")
        constraint = None if plan is None else plan.structured_outputs()
        if constraint is not None:
            if any(p.structured_outputs is not None for p in params):
                raise ValueError("tools constrain the output (tool_choice required or named, or "
                                 "a strict tool): sampling_params cannot constrain it too")
            params = [dataclasses.replace(p, structured_outputs=constraint) for p in params]
        results = _run(self._generate(requests, params, use_tqdm))
        return results if plan is None or not plan.parses else _with_tool_calls(results, plan)

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, as the pipeline's tokenizer process loads it."""
        return self._tokenizer

    @functools.cached_property
    def _tokenizer(self) -> Any:
        from frontend.actors.model_tokenizer import load_tokenizer

        return load_tokenizer(self.config.model_dir)

    def _chat_prompt_ids(self, conversation: list[dict[str, str]],
                         template_kwargs: dict[str, Any]) -> list[int]:
        tokenizer = self._tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template; use generate with a prompt")
        kwargs = {"add_generation_prompt": True, **template_kwargs, "tokenize": False}
        text = tokenizer.apply_chat_template(conversation, **kwargs)
        # The template writes the special tokens (BOS included) itself, as in the tokenizer.
        return tokenizer.encode(text, add_special_tokens=False)

    async def _generate(self, requests: list[dict[str, Any]], params: list[SamplingParams],
                        use_tqdm: bool) -> list[dict[str, Any]]:
        """requests: the prompt keyword arguments of AsyncClient.stream, one dict each. A
        prompt whose params ask for n > 1 is n engine requests (see _grouped)."""
        choices = [(i, kwargs, p) for i, (kwargs, sp) in enumerate(zip(requests, params))
                   for p in choice_params(sp, sp.n)]
        bar = tqdm(total=len(choices), desc="Generating", dynamic_ncols=True,
                   disable=not use_tqdm)
        meter = _Throughput()
        async with AsyncClient(self.pipeline.address) as client:

            async def one(kwargs: dict[str, Any], sp: SamplingParams) -> dict[str, Any]:
                # The whole output in one delta: a stream would cost the detokenizer and this
                # process a message per request per step, more than a small model's step.
                out = await client.generate(params=sp, **kwargs)
                meter.prefill_tokens += out.prompt_tokens
                meter.decode_tokens += out.completion_tokens
                bar.update(1)
                bar.set_postfix_str(meter.postfix(), refresh=False)
                result = {"text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason, "metrics": out.metrics}
                if sp.logprobs:
                    result["logprobs"] = out.logprobs
                if sp.top_logprobs:
                    result["top_logprobs"] = out.top_logprobs
                return result

            try:
                results = await asyncio.gather(*(one(r, p) for _, r, p in choices))
            finally:
                bar.close()
        return _grouped([i for i, _, _ in choices], results)


def _with_tool_calls(results: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    for result in results:
        for out in result.get("outputs", [result]):
            content, calls = plan.parse(out["text"])
            out["tool_calls"] = [c.to_openai() for c in calls]
            out["content"] = content
    return results


def _grouped(prompt_of: list[int], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per prompt. With n > 1 it is the first completion's, plus `outputs`: all n
    (vLLM's RequestOutput.outputs), so code written for n = 1 reads the same keys."""
    per_prompt: dict[int, list[dict[str, Any]]] = {}
    for i, result in zip(prompt_of, results, strict=True):
        per_prompt.setdefault(i, []).append(result)
    return [group[0] if len(group) == 1 else {**group[0], "outputs": group}
            for group in per_prompt.values()]


def _run(main: Coroutine[Any, Any, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run main to its end, from a plain script or from inside a running event loop.

    Ctrl-C cancels main (aborting its requests; the engine serves on) and reaches the caller
    as a bare KeyboardInterrupt: the CancelledError inside is no news to the user."""
    try:
        asyncio.get_running_loop()
        inside_a_loop = True
    except RuntimeError:
        inside_a_loop = False
    try:
        return _run_beside(main) if inside_a_loop else _run_here(main)
    except KeyboardInterrupt:
        raise KeyboardInterrupt from None


def _run_beside(main: Coroutine[Any, Any, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Inside a running event loop (a notebook cell, an async app): that loop cannot run main
    while this call blocks it, so main runs in a loop of its own on a thread, and this call
    waits for it as any synchronous call would. Ctrl-C cancels it (aborting its requests)."""
    loop = asyncio.new_event_loop()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = loop.run_until_complete(main)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            box["error"] = exc
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=target, name="nanopipe-llm-call", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)
    except KeyboardInterrupt:
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join()
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]


def _run_here(main: Coroutine[Any, Any, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """asyncio.run(main), with Ctrl-C always a KeyboardInterrupt. asyncio.run turns Ctrl-C
    into one, except when the signal is handled while it sets up (CPython's runner installs
    its SIGINT handler, then resets the interrupt count the handler raised): main then ends
    cancelled before it ran, and CancelledError would reach the user. Nothing else cancels
    main, so its cancellation here is always a Ctrl-C."""
    try:
        return asyncio.run(main)
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None


def _params_per_request(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                        count: int, what: str) -> list[SamplingParams]:
    """One SamplingParams per request; a dict of its fields stands for one. Checked here: a
    wrong type would otherwise fail deep in the request's encoding."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams | Mapping):
        return [as_sampling_params(sampling_params, "sampling_params")] * count
    if isinstance(sampling_params, str) or not isinstance(sampling_params, Sequence):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    if len(sampling_params) != count:
        raise ValueError(f"sampling_params must be one or one per {what}")
    return [as_sampling_params(p, f"sampling_params[{i}]") for i, p in enumerate(sampling_params)]


def _as_conversations(value: Conversation | Sequence[Conversation]) -> list[list[dict[str, str]]]:
    """One conversation or a list of them, as lists of {"role", "content"} with text content."""
    if isinstance(value, str | Mapping) or not isinstance(value, Sequence) or not value:
        raise TypeError("messages must be a non-empty list of "
                        '{"role", "content"} dicts, or a list of such lists')
    batch = not isinstance(value[0], Mapping)
    conversations = list(value) if batch else [value]
    out = []
    for i, conversation in enumerate(conversations):
        where = f"conversations[{i}]" if batch else "messages"
        if isinstance(conversation, str | Mapping) or not isinstance(conversation, Sequence):
            raise TypeError(f"{where} must be a list of {{\"role\", \"content\"}} dicts")
        if not conversation:
            raise ValueError(f"{where} must not be empty")
        out.append([_message(m, f"{where}[{j}]") for j, m in enumerate(conversation)])
    return out


def _message(message: Any, where: str) -> dict[str, str]:
    msg = as_chat_message(message, where)
    if msg.role not in CHAT_ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, "
                         f"got {msg.role!r}")
    return {"role": msg.role, "content": msg.content}


class _Throughput:
    """The progress bar's speeds, counted from finished requests (as vLLM's estimate is)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.prefill_tokens = 0
        self.decode_tokens = 0

    def postfix(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (f"est. speed input: {self.prefill_tokens / elapsed:.0f} tok/s, "
                f"output: {self.decode_tokens / elapsed:.0f} tok/s")
