"""The OpenAI-compatible HTTP server's entry: connect to a running pipeline, serve the app.

`python -m frontend.openai_server.server --address PIPELINE_ADDRESS --port 8000` serves
/v1/completions, /v1/chat/completions (streaming over SSE or not), /v1/models, /health and
/metrics (Prometheus; when the pipeline's stats can be followed: an ipc pipeline, or the
launcher's own) on 127.0.0.1. The routes are in `app`, the answering of one request in `streaming`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Callable

from frontend.metrics import EngineMetrics, follow
from frontend.openai_server.app import create_app
from frontend.openai_server.body_limit import JSON_ROOM_BYTES, MAX_BYTES_PER_TOKEN
from frontend.openai_server.draining import Drain
from protocol.reasoning import PARSERS


def serve(address: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, log_level: str = "info",
          max_request_bytes: int | None = None, *,
          sock: socket.socket | None = None,
          engine_alive: Callable[[], bool] | None = None,
          metrics: EngineMetrics | None = None,
          degraded: Callable[[], str | None] | None = None,
          reasoning_parser: str | None = None) -> str | None:
    """Connect to the pipeline at `address` and serve it over HTTP until interrupted.

    `sock`, when given, is an already bound listening socket (host and port are then
    ignored). `engine_alive`, when given, is polled: the server stops once it returns False,
    so the HTTP front never outlives its engine; it stops too once its own client of the
    pipeline is dead while the engine lives (no reconnection could help), and then returns
    why, so its launcher can exit with an error rather than serve 503s forever. Stopping
    drains: see `draining`. `metrics`, when given, are served on /metrics; otherwise this
    server follows the pipeline's stats itself where it can without credentials (an ipc
    pipeline).
    `degraded`, when given, is /health's source for replicas that are down (see
    health.health_of).
    """
    import uvicorn

    from frontend.client.async_client import AsyncClient

    lost: list[str] = []

    async def run() -> None:
        async with AsyncClient(address) as client:
            name = model_name or client.welcome.model
            own = None
            stats_at = client.welcome.deltas_address
            if metrics is None and stats_at.startswith("ipc://"):
                own_metrics, own = follow(stats_at, None)
            drain = Drain()
            app = create_app(client, name, api_key, max_request_bytes=max_request_bytes,
                             metrics=metrics if own is None else own_metrics,
                             degraded=degraded, drained=drain.over, stopping=drain.stopping,
                             reasoning_parser=reasoning_parser)
            config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    lifespan="off",
                                    timeout_graceful_shutdown=drain.uvicorn_timeout_s)
            server = uvicorn.Server(config)
            drain.attach(server)

            def alive() -> bool:
                assert engine_alive is not None
                if engine_alive() and client.dead_reason is not None and not lost:
                    lost.append(client.dead_reason)
                return engine_alive() and not lost

            watch = asyncio.ensure_future(
                drain.watch(server, alive if engine_alive is not None else None))
            try:
                await server.serve(sockets=[sock] if sock is not None else None)
            finally:
                watch.cancel()
                if own is not None:
                    own.close()

    try:
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())
    return lost[0] if lost else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="OpenAI-compatible HTTP server for nanopipe")
    parser.add_argument("--address", required=True,
                        help="the pipeline's client address (printed by the launcher)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients use (default: the pipeline's model)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="refuse larger request bodies with 413 (default: "
                        f"{MAX_BYTES_PER_TOKEN} x max_model_len + {JSON_ROOM_BYTES})")
    parser.add_argument("--reasoning-parser", default=None, choices=PARSERS,
                        help="split chat answers' reasoning_content off their content")
    args = parser.parse_args(argv)
    try:
        serve(args.address, args.host, args.port, args.api_key, args.served_model_name,
              args.log_level, args.max_request_bytes, reasoning_parser=args.reasoning_parser)
    except KeyboardInterrupt:
        # uvicorn stops gracefully on Ctrl-C and then raises the signal again for its
        # caller; the stop it asked for is done, so it ends the program without an error.
        pass


if __name__ == "__main__":
    main()
