"""AsyncClient against the real tokenizer and detokenizer processes (stand-in scheduler)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os

import pytest
from transformers import AutoTokenizer

from frontend import AsyncClient, ClientClosedError, RequestRejected
from protocol import FinishReason, SamplingParams

PROMPT = "The capital of France is Paris."


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


async def until(condition, timeout: float = 10.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def aborted(pipe, request_id: int) -> bool:
    return any(request_id in a.request_ids and a.reason is FinishReason.ABORT
               for a in pipe.scheduler.aborts)


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_concurrent_generate_and_stream(pipe, tokenizer):
    texts = [f"{i} children walk to school {i}" for i in range(20)]

    async def one(client: AsyncClient, i: int) -> str:
        params = SamplingParams(max_tokens=len(tokenizer.encode(texts[i])))
        if i % 2:
            return "".join([d.text async for d in client.stream(texts[i], params=params)])
        return (await client.generate(texts[i], params=params)).text

    async def main() -> list[str]:
        async with AsyncClient(pipe.address) as client:
            assert client.welcome.model == "tiny"
            return await asyncio.gather(*(one(client, i) for i in range(len(texts))))

    assert run(main()) == texts


def test_rejection_and_stop_string(pipe):
    async def main() -> None:
        async with AsyncClient(pipe.address) as client:
            with pytest.raises(RequestRejected, match="prompt must not be empty"):
                await client.generate("")
            with pytest.raises(RequestRejected, match=r"prompt_token_ids\[0\]"):
                async for _ in client.stream(prompt_token_ids=[10**6]):
                    pass
            out = await client.generate(PROMPT, params=SamplingParams(max_tokens=20,
                                                                      stop=["France"]))
            assert (out.text, out.finish_reason) == ("The capital of ", "stop")

    run(main())


def test_aclose_and_cancel_abort_the_request(pipe):
    async def main() -> None:
        async with AsyncClient(pipe.address) as client:
            stream = client.stream(PROMPT, params=SamplingParams(max_tokens=100,
                                                                 ignore_eos=True))
            await stream.__anext__()
            rid = pipe.scheduler.added[-1].request_id
            await stream.aclose()
            await until(lambda: aborted(pipe, rid))

            pipe.scheduler.paused = True
            try:
                task = asyncio.ensure_future(client.generate(PROMPT))
                await until(lambda: pipe.scheduler.running() == 1)
                rid = pipe.scheduler.added[-1].request_id
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await until(lambda: aborted(pipe, rid))
            finally:
                pipe.scheduler.paused = False

    run(main())


def test_explicit_abort_finishes_the_stream_with_abort(pipe):
    """As with Client: abort(id) stops the request, and whoever reads it sees "abort"."""

    async def main() -> list[str | None]:
        async with AsyncClient(pipe.address, timeout=30) as client:
            pipe.scheduler.paused = True
            try:
                stream = client.stream(PROMPT, params=SamplingParams(max_tokens=100))
                first = asyncio.ensure_future(stream.__anext__())
                await until(lambda: pipe.scheduler.running() == 1)
                await client.abort(stream.request_id)
                deltas = [await first] + [d async for d in stream]
            finally:
                pipe.scheduler.paused = False
            return [d.finish_reason for d in deltas]

    assert run(main()) == ["abort"]


def test_close_aborts_in_flight(pipe):
    async def main() -> None:
        pipe.scheduler.paused = True
        try:
            client = AsyncClient(pipe.address)
            task = asyncio.ensure_future(client.generate(PROMPT))
            await until(lambda: pipe.scheduler.running() == 1)
            rid = pipe.scheduler.added[-1].request_id
            await client.close()
            with pytest.raises(ClientClosedError):
                await task
            await until(lambda: aborted(pipe, rid))
        finally:
            pipe.scheduler.paused = False

    run(main())


def test_a_dropped_client_closes_itself(pipe):
    """Neither closed nor used with `async with`: the abandoned stream's request is aborted,
    and once the client is collected its reader stops and its sockets close."""
    async def main() -> None:
        pipe.scheduler.paused = True
        try:
            client = AsyncClient(pipe.address)
            stream = client.stream(PROMPT, params=SamplingParams(max_tokens=50))
            first = asyncio.ensure_future(anext(stream))
            await until(lambda: pipe.scheduler.running() == 1)
            rid = pipe.scheduler.added[-1].request_id
            conn = client._conn
            first.cancel()  # the caller gives up on the stream and drops both objects
            with contextlib.suppress(asyncio.CancelledError):
                await first
            del client, stream, first
            gc.collect()
            await until(lambda: aborted(pipe, rid))
            await until(lambda: conn.closed and conn.ctx is None)
            assert conn.reader.done()
        finally:
            pipe.scheduler.paused = False

    run(main())


def test_under_uvloop(pipe):
    uvloop = pytest.importorskip("uvloop")

    async def main() -> str:
        async with AsyncClient(pipe.address) as client:
            return (await client.generate(PROMPT, params=SamplingParams(max_tokens=3))).text

    assert uvloop.run(main()) == "The capital of"


def test_a_cancelled_close_is_not_swallowed():
    """Ctrl-C under asyncio.run cancels the main task; landing while a client closes (the
    reader winding down), it must still reach the program instead of being absorbed with the
    reader's own cancellation (a plain script then slept on, deaf to Ctrl-C)."""
    import types

    from frontend.client.async_client import _AsyncConnection

    async def main() -> None:
        async def reader() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(0.2)  # the reader's clean-up takes a while
                raise

        conn = types.SimpleNamespace(reader=asyncio.ensure_future(reader()))
        await asyncio.sleep(0)
        closer = asyncio.ensure_future(_AsyncConnection._stop_reader(conn))
        await asyncio.sleep(0.05)  # the closer now waits on the reader
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        await asyncio.wait([conn.reader])
        assert conn.reader.cancelled()

    asyncio.run(main())


def test_a_cancelled_close_still_releases_the_sockets():
    """The closing task's cancellation goes on, after the sockets and the context are closed."""
    import types

    from frontend.client.async_client import _AsyncConnection

    released = []

    async def stop_reader() -> None:
        await asyncio.sleep(3600)  # the reader is slow to wind down

    async def main() -> None:
        conn = types.SimpleNamespace(core=types.SimpleNamespace(closed=False, close=list),
                                     _apply=lambda actions: None, _stop_reader=stop_reader,
                                     release=lambda: released.append(True))
        closer = asyncio.ensure_future(_AsyncConnection.aclose(conn))
        await asyncio.sleep(0.05)
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer

    asyncio.run(main())
    assert released == [True]


def test_a_second_event_loop_is_told_the_client_belongs_to_the_first(pipe):
    """asyncio.run twice with one AsyncClient (as a notebook might): the second loop's request
    fails at once, instead of waiting on the first loop's closed sockets; a new client works."""
    client = AsyncClient(pipe.address)

    async def one(c: AsyncClient) -> str:
        return (await c.generate(PROMPT, params=SamplingParams(max_tokens=3))).finish_reason

    assert run(one(client)) == "length"
    with pytest.raises(RuntimeError, match="belongs to the event loop it started on"):
        run(one(client), timeout=10)
    assert run(one(AsyncClient(pipe.address))) == "length"


def test_a_client_dropped_after_its_loop_ended_releases_its_sockets(pipe):
    """Used in one asyncio.run and never closed: dropping it closes its sockets and context
    right away (left open, the context blocked the thread that later garbage-collected it)."""
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def use(c: AsyncClient) -> str:
        return (await c.generate(PROMPT, params=SamplingParams(max_tokens=2))).finish_reason

    gc.collect()
    before = open_fds()
    client = AsyncClient(pipe.address)
    assert run(use(client)) == "length"
    assert open_fds() > before
    del client
    gc.collect()
    assert open_fds() == before
    assert run(use(AsyncClient(pipe.address))) == "length"
