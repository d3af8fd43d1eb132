"""A pipeline that dies under a running server: /health turns 503, streams end in an error."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
from http_serving import running_server

from frontend import AsyncClient, Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.openai_server.app import create_app
from protocol import SamplingParams

ENGINE = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=256)


def test_engine_death_under_a_running_server(tiny_llama_dir):
    with Pipeline(EngineConfig(model=tiny_llama_dir, **ENGINE)) as pipeline:

        @contextlib.asynccontextmanager
        async def make_app():
            async with AsyncClient(pipeline.address) as client:
                yield create_app(client, "llama")

        with running_server(make_app) as url, httpx.Client(base_url=url, timeout=30) as http:
            # A second architecture through HTTP, greedy, equal to the client library.
            with Client(pipeline.address) as direct:
                expected = direct.generate("hello there", params=SamplingParams(
                    temperature=0, max_tokens=12, ignore_eos=True)).text
            body = {"model": "llama", "prompt": "hello there", "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
            assert http.get("/health").json() == {"status": "ready", "reason": None}

            stream_body = {**body, "max_tokens": 400, "stream": True}
            with http.stream("POST", "/v1/completions", json=stream_body) as resp:
                assert resp.status_code == 200
                events = (line for line in resp.iter_lines() if line)
                assert "choices" in json.loads(next(events)[len("data: "):])
                pipeline.stop(grace_s=0.5)
                rest = list(events)
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][len("data: "):])["error"]["type"] == "engine_dead"

            # Until the stopped pipeline is known gone (its sockets refuse), the server only
            # knows that its connection dropped: 503 "reconnecting".
            deadline, seen = time.monotonic() + 15, set()
            while (health := http.get("/health").json())["status"] != "dead":
                seen.add(health["status"])
                assert time.monotonic() < deadline, "/health never noticed the dead engine"
                time.sleep(0.05)
            assert health["reason"] and seen <= {"ready", "reconnecting"}, (health, seen)
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 503
            assert resp.json()["error"]["type"] == "engine_dead"
