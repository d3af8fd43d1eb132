"""Stopping the HTTP server (SIGTERM, Ctrl-C) with requests in flight: those that finish within
the grace are answered as usual, the rest get a JSON 503 or, on a stream, an error event and
`[DONE]`; none is cut off bare, and their engine requests are aborted."""

from __future__ import annotations

import json
import threading
import time

import httpx
from http_fakes import FakeClient
from http_serving import running_server, static_app

from frontend.openai_server.app import create_app
from frontend.openai_server.draining import Drain

GRACE_S = 1.0


def test_requests_in_flight_when_the_server_stops_are_answered():
    fake = FakeClient(token_delay_s=0.1)
    drain = Drain(grace_s=GRACE_S)
    servers = []

    async def watch(server):
        servers.append(server)
        await drain.watch(server)

    app = create_app(fake, "fake-model", drained=drain.over)
    answers: dict[str, object] = {}

    def ask(name: str, body: dict) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            if body.get("stream"):
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    answers[name] = (resp.status_code, [line for line in resp.iter_lines()])
            else:
                resp = http.post("/v1/completions", json=body)
                answers[name] = (resp.status_code, resp.json())

    with running_server(lambda: static_app(app), beside=watch,
                        graceful_s=drain.uvicorn_timeout_s) as url:
        asks = [threading.Thread(target=ask, args=args) for args in [
            ("short", {"prompt": "p", "max_tokens": 3}),  # done within the grace
            ("long", {"prompt": "p", "max_tokens": 200}),
            ("long stream", {"prompt": "p", "max_tokens": 200, "stream": True}),
        ]]
        for t in asks:
            t.start()
        time.sleep(0.2)
        servers[0].should_exit = True  # what uvicorn's SIGTERM handler does
        for t in asks:
            t.join(10)

    status, body = answers["short"]
    assert status == 200 and body["choices"][0]["text"] == "t0 t1 t2 "
    status, body = answers["long"]
    assert status == 503 and body["error"]["code"] == "shutting_down", body
    status, lines = answers["long stream"]
    events = [line.removeprefix("data: ") for line in lines if line]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert streamed.startswith("t0 t1 t2 ")  # it streamed until the grace was over
    long_calls = [c for c in fake.calls if c.params.max_tokens == 200]
    assert len(long_calls) == 2 and all(c.aborted for c in long_calls)
