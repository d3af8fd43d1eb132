"""A stand-in for AsyncClient: scripted deltas, and a record of what the server asked for."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from frontend.client.outputs import (
    ConnectionLostError,
    EngineDeadError,
    OutputCollector,
    RequestDelta,
    RequestRejected,
)
from protocol import ClientWelcome, ErrorKind, SamplingParams

REJECT = "please reject me"
DIE_MIDWAY = "die after two tokens"
CRASH = "a bug in the client library"
BUSY = "too much waiting"
UNRUNNABLE = "the engine cannot run this"
DEAD_REASON = "worker 0 exited with code 1"


@dataclass
class Call:
    request_id: str
    kwargs: dict[str, Any]
    params: SamplingParams
    stream: bool
    client_key: str | None = None
    finished: bool = False
    aborted: bool = False


@dataclass
class FakeClient:
    """Each request makes max_tokens tokens, ids 100, 101, ..., text "t0 t1 ..."."""

    model: str = "fake-model"
    max_model_len: int = 512
    dead: bool = False
    lost: str | None = None
    """Set: the connection dropped and the client is reconnecting (requests fail at once)."""
    started: bool = True
    """False: the handshake with the pipeline has not finished (no welcome yet)."""
    token_delay_s: float = 0.0
    fail_seed: int | None = None
    """A request with this seed dies after two tokens (one choice of several failing)."""
    calls: list[Call] = field(default_factory=list)
    script: list[str] | None = None
    """Set: every request streams these pieces of text (one token each), then stops."""

    @property
    def welcome(self) -> ClientWelcome | None:
        if not self.started:
            return None
        return ClientWelcome(results_address="", model=self.model,
                             max_model_len=self.max_model_len)

    @property
    def dead_reason(self) -> str | None:
        return DEAD_REASON if self.dead else None

    @property
    def lost_reason(self) -> str | None:
        return self.lost

    def _deltas(self, call: Call) -> AsyncIterator[RequestDelta]:
        async def gen() -> AsyncIterator[RequestDelta]:
            if self.dead:
                raise EngineDeadError(DEAD_REASON)
            if self.lost is not None:
                raise ConnectionLostError(self.lost)
            if call.kwargs.get("prompt") == CRASH:
                raise RuntimeError("boom")
            if call.kwargs.get("prompt") == REJECT:
                raise RequestRejected("prompt: this prompt is refused", "prompt")
            if call.kwargs.get("prompt") == BUSY:
                raise RequestRejected("busy: retry when some finish", kind=ErrorKind.BUSY)
            if call.kwargs.get("prompt") == UNRUNNABLE:
                raise RequestRejected("the engine could not run this request: no",
                                      kind=ErrorKind.REQUEST_FAILED)
            params = call.params
            n_prompt = len(call.kwargs.get("prompt_token_ids") or []) or 7
            if params.max_tokens is None:  # the rest of the context, as the tokenizer does
                params = dataclasses.replace(params, max_tokens=self.max_model_len - n_prompt)
            if n_prompt + params.max_tokens > self.max_model_len:
                # Worded as the tokenizer words it.
                raise RequestRejected(
                    f"the prompt has {n_prompt} tokens and params.max_tokens is "
                    f"{params.max_tokens}: together they exceed max_model_len "
                    f"{self.max_model_len}; lower max_tokens to at most "
                    f"{self.max_model_len - n_prompt}", "params.max_tokens")
            if self.script is not None:
                for i, piece in enumerate(self.script):
                    last = i == len(self.script) - 1
                    yield RequestDelta(
                        request_id=call.request_id, text=piece, token_ids=[100 + i],
                        finish_reason="stop" if last else None, prompt_tokens=n_prompt,
                        completion_tokens=i + 1,
                        logprobs=[-0.5 - i] if params.logprobs else None)
                call.finished = True
                return
            try:
                for i in range(params.max_tokens):
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    dies = (call.kwargs.get("prompt") == DIE_MIDWAY
                            or (self.fail_seed is not None and params.seed == self.fail_seed))
                    if dies and i == 2:
                        raise EngineDeadError("scheduler exited with code 1")
                    last = i == params.max_tokens - 1
                    yield RequestDelta(
                        request_id=call.request_id, text=f"t{i} ", token_ids=[100 + i],
                        finish_reason="length" if last else None, prompt_tokens=n_prompt,
                        completion_tokens=i + 1,
                        logprobs=[-0.5 - i] if params.logprobs else None,
                        top_logprobs=[[(100 + i, -0.5 - i)] + [
                            (1000 + j, -10.0 - j) for j in range(params.top_logprobs - 1)]]
                        if params.top_logprobs else None,
                    )
                call.finished = True
            finally:
                if not call.finished:
                    call.aborted = True

        return gen()

    def _call(self, kwargs: dict[str, Any], params: SamplingParams | None, stream: bool) -> Call:
        key = kwargs.pop("client_key", None)
        call = Call(f"req-{len(self.calls)}", kwargs, params or SamplingParams(), stream, key)
        self.calls.append(call)
        return call

    def stream(self, prompt: str | None = None, *, params: SamplingParams | None = None,
               **kwargs: Any) -> AsyncIterator[RequestDelta]:
        if prompt is not None:
            kwargs["prompt"] = prompt
        return self._deltas(self._call(kwargs, params, True))

    async def generate(self, prompt: str | None = None, *, params: SamplingParams | None = None,
                       **kwargs: Any):
        if prompt is not None:
            kwargs["prompt"] = prompt
        call = self._call(kwargs, params, False)
        collector = OutputCollector(call.request_id)
        deltas = self._deltas(call)
        try:
            async for delta in deltas:
                collector.add(delta)
        finally:
            await deltas.aclose()
        return collector.output()
