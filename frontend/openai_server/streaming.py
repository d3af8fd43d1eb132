"""Answering one HTTP request from its engine requests (one per choice): a whole JSON body,
or SSE events as deltas arrive. A client that goes away aborts its requests, so the engine
stops spending KV blocks on it; an error after the headers travels as an event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from frontend.client.outputs import RequestRejected
from frontend.openai_server.draining import shutting_down
from frontend.openai_server.errors import api_error
from frontend.openai_server.responses import ChatFormat, CompletionFormat
from protocol import SamplingParams
from protocol.client_messages import RequestFieldError

if TYPE_CHECKING:
    from frontend.client.async_client import AsyncClient

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - orjson is optional
    import json

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


T = TypeVar("T")
Choice = tuple[dict[str, Any], SamplingParams]
"""A choice's prompt (the client's prompt keyword arguments) and its parameters."""
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready; its request is aborted."""


async def _until_disconnected(request: Request, work: Awaitable[T], drained: asyncio.Event
                              ) -> T:
    """Await `work`, cancelling it (which aborts its request) if the HTTP client goes away or
    the server's grace for stopping ends (`drained`)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    drain = asyncio.ensure_future(drained.wait())
    try:
        await asyncio.wait({work_task, watch, drain}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        drain.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(BaseException):
                await work_task
    if work_task.cancelled():
        raise shutting_down() if drained.is_set() else ClientGone()
    return work_task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answer(request: Request, client: AsyncClient, choices: list[Choice], stream: bool,
                 fmt: CompletionFormat | ChatFormat, drained: asyncio.Event,
                 constrained_by: str | None = None) -> Response:
    """One engine request per choice (each prompt times `n`); a prompt shared by n choices is
    a prefix-cache hit. Once `drained` is set (the server stopping, its grace over) what
    still runs is a 503. `constrained_by`: the body field that constrained the output, which
    the engine's errors about that constraint are told to name (errors.http_param)."""
    if not stream:
        outs = await _named(constrained_by, _until_disconnected(request, _all_or_none(
            [client.generate(**prompt, params=p) for prompt, p in choices]), drained))
        return JSONResponse(fmt.response(outs))
    streams = [client.stream(**prompt, params=p) for prompt, p in choices]
    try:
        # Wait for each choice's first delta before answering 200, so a rejection is a 400.
        firsts = await _named(constrained_by, _until_disconnected(request, _all_or_none(
            [anext(s, None) for s in streams]), drained))
    except BaseException:
        await _close_all(*streams)
        raise
    events = _sse(fmt, len(streams), _merged(firsts, streams, drained), constrained_by)
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(_close_all, events, *streams))


async def _named(constrained_by: str | None, work: Awaitable[T]) -> T:
    """`work`'s result; an engine rejection becomes the HTTP error naming the body's fields."""
    try:
        return await work
    except (RequestRejected, RequestFieldError) as exc:
        raise api_error(exc, constrained_by) from None


async def _all_or_none(works: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure with the rest cancelled (which aborts them)."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(firsts: list[Any], streams: list[AsyncIterator[Any]], drained: asyncio.Event
                  ) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, delta) from every stream in arrival order; a failure, or the end of the
    server's grace for stopping, ends it."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def stop_when_drained() -> None:
        await drained.wait()
        await queue.put((-1, None, shutting_down()))

    async def pump(index: int, delta: Any, stream: AsyncIterator[Any]) -> None:
        try:
            while delta is not None:
                await queue.put((index, delta, None))
                delta = await anext(stream, None)
        except Exception as exc:
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, first, stream))
             for i, (first, stream) in enumerate(zip(firsts, streams, strict=True))]
    tasks.append(asyncio.ensure_future(stop_when_drained()))
    try:
        running = len(streams)
        while running:
            index, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is None:
                running -= 1
            else:
                yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sse(fmt: CompletionFormat | ChatFormat, num_choices: int,
               deltas: AsyncIterator[tuple[int, Any]], constrained_by: str | None = None
               ) -> AsyncIterator[bytes]:
    try:
        for chunk in fmt.start_chunks(num_choices):
            yield _event(chunk)
        async for index, delta in deltas:
            for chunk in fmt.delta_chunks(delta, index):
                yield _event(chunk)
        for chunk in fmt.end_chunks():
            yield _event(chunk)
    except Exception as exc:
        # Headers are gone already: the error travels as an event, as OpenAI's server does.
        yield _event(api_error(exc, constrained_by).body())
    finally:
        await _close(deltas)
    yield b"data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def _close(it: Any) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(it, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def _close_all(*its: Any) -> None:
    """Runs after the response, also after a disconnect cancelled it mid-stream."""
    for it in its:
        await _close(it)
