"""The command line: `nanopipe serve [MODEL]` (and `scripts/launch.sh`, the same flags).

It runs a whole pipeline in the foreground until Ctrl-C or SIGTERM, printing what start-up
is doing. Clients reach it over ZeroMQ at the printed address, and over the
OpenAI-compatible HTTP API on 127.0.0.1:8000 (`--port`, `--host`; `--no-http` serves none);
Prometheus scrapes its metrics at the HTTP server's /metrics, or at `--metrics-port`. Every
check that needs no process (model path, device, tensor-parallel size, ports) is made before
anything starts, and a wrong one is a one-line error. The flags: serve_flags.py; exit
statuses: usage.py.
"""

from __future__ import annotations

import functools
import importlib
import signal
import socket
import sys
import threading
from typing import Any

from frontend.engine.log_config import configure_logging
from frontend.engine.options import ConfigError
from frontend.engine.pipeline import Pipeline
from frontend.engine.preflight import port_unavailable, warn_if_exposed
from frontend.engine.serve_flags import ServeCommand, package_version, parse_serve_args
from frontend.engine.startup import StartupError
from frontend.engine.stop_signal import StopSignal
from frontend.engine.usage import (
    EXIT_FAILED,
    EXIT_STOPPED,
    EXIT_USAGE,
    OneLineParser,
    closest,
)

HTTP_BACKLOG = 128
"""Connections the HTTP port queues while start-up answers them "starting"."""


def print_progress(text: str) -> None:
    """What start-up is doing, on stderr (stdout carries the addresses users copy)."""
    print(f"nanopipe: {text}", file=sys.stderr, flush=True)


def _bind_http(host: str, port: int) -> socket.socket:
    """Take the HTTP port (bound and listening) before the engine starts: a taken port fails
    in one line, at once. Listening at once matters: with SO_REUSEADDR two launchers may both
    bind one port until one of them listens, and the other's later listen would fail."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(HTTP_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ValueError(port_unavailable(host, port, "the HTTP", exc)) from None
    return sock


def _preload(module: str) -> None:
    """Import `module` now, in the background: the HTTP server's modules (FastAPI's) take
    a few tenths of a second, which start-up hides and serving would wait for. A failure
    is left for the import that uses the module to report."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - reported by the later import
        pass


def serve(command: ServeCommand) -> int:
    """Run the pipeline (and the HTTP API) until stopped; 1 when the engine died."""
    config, http = command.engine, command.http
    configure_logging(http.log_level)
    # Installed before anything starts, so a SIGTERM during start-up still stops everything.
    stop = StopSignal()
    signal.signal(signal.SIGTERM, stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not a background job
        signal.signal(signal.SIGINT, stop)
    if config.node_rank > 0:  # another host of a multi-host group: its worker ranks only
        from frontend.engine.nodes import serve_node

        return serve_node(config, print_progress)
    http_sock = None
    metrics = metrics_server = None
    stats_subs: list[Any] = []
    if http.serve_http or http.metrics_port is not None:
        from frontend.metrics import EngineMetrics, MetricsServer, StatsSubscriber

        metrics = EngineMetrics(cache_config={
            "block_size": str(config.resolved_block_size),
            "cache_dtype": config.kv_cache_label,
            "kv_offloading_gib": str(config.resolved_kv_offloading_size)})
    try:
        if http.serve_http:
            http_sock = _bind_http(http.host, http.port)
            if http.api_key is None:
                warn_if_exposed("the HTTP API", http.host, "--api-key")
        if http.metrics_port is not None:
            metrics_server = MetricsServer(metrics.registry, http.metrics_host,
                                           http.metrics_port)
    except ValueError as exc:
        print(f"nanopipe: {exc}", file=sys.stderr, flush=True)
        if http_sock is not None:
            http_sock.close()
        return EXIT_FAILED
    # While the engine starts, the HTTP port answers 503 "starting" (with the progress).
    starting = None
    if http_sock is not None:
        from frontend.openai_server.starting import StartingResponder

        starting = StartingResponder(http_sock)
        threading.Thread(target=_preload, args=("frontend.openai_server.server",),
                         name="nanopipe-preload", daemon=True).start()

    def progress(text: str) -> None:
        print_progress(text)
        if starting is not None:
            starting.reason = text

    pipeline = Pipeline(config, on_progress=progress)
    try:
        try:
            pipeline.start()
        finally:
            if starting is not None:
                starting.close()
        stop.check()
        if pipeline.startup is not None:  # where the time went, phase by phase
            print_progress(pipeline.startup.line())
        if metrics is not None:  # every replica publishes its own stats
            stats_subs = [StatsSubscriber(r.deltas_pub, pipeline.endpoints.keys,
                                          functools.partial(metrics.update, source=i))
                          for i, r in enumerate(pipeline.replicas)]
        print(f"nanopipe ready: {config.model_name} on {config.resolved_device}"
              f" (tp={config.tensor_parallel_size}"
              f"{f', dp={config.data_parallel_size}' if config.data_parallel_size > 1 else ''}"
              f", {pipeline.num_kv_blocks} KV blocks of {config.kv_cache_label})",
              flush=True)
        print(f"clients connect to: {pipeline.address}", flush=True)
        # Over tcp an attached tool needs the run's keys, kept in the private run directory.
        attach_at = pipeline.address if pipeline.endpoints.keys is None \
            else pipeline.endpoints.run_dir
        print(f"attach a detokenizer: python -m frontend.actors.stdout_detokenizer "
              f"--model {config.model_dir} {attach_at}", flush=True)
        if metrics_server is not None:
            print(f"Prometheus metrics: {metrics_server.url}", flush=True)
        if http_sock is not None:
            from frontend.openai_server.server import serve as serve_http

            host, port = http_sock.getsockname()[:2]
            print(f"HTTP API: http://{host}:{port}/v1", flush=True)
            lost = serve_http(pipeline.address, sock=http_sock, api_key=http.api_key,
                              model_name=config.served_model_name, log_level=http.log_level,
                              max_request_bytes=http.max_request_bytes,
                              reasoning_parser=http.reasoning_parser,
                              engine_alive=lambda: pipeline.dead_reason is None,
                              metrics=metrics, degraded=lambda: pipeline.degraded)
            # A client dead while the engine lives: unless the engine's death (which the
            # client may hear first) shows up within a second, the launcher must not hang on.
            if lost is not None and not pipeline.wait(timeout=1.0):
                print(f"nanopipe: the HTTP server lost the engine: {lost}", file=sys.stderr,
                      flush=True)
                return EXIT_FAILED
        else:
            print("HTTP API: off (--no-http)", flush=True)
            while not pipeline.wait(timeout=1.0):
                stop.check()
        if pipeline.dead_reason is not None:
            print(f"nanopipe: engine dead: {pipeline.dead_reason}", file=sys.stderr, flush=True)
            return EXIT_FAILED
    except (StartupError, ConfigError) as exc:
        print(f"nanopipe: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("nanopipe: stopping", file=sys.stderr, flush=True)
    finally:
        for sub in stats_subs:
            sub.close()
        pipeline.stop()
        if metrics_server is not None:
            metrics_server.close()
        if http_sock is not None:
            http_sock.close()
    return EXIT_STOPPED


COMMANDS = ("serve", "bench", "profile")


def main(argv: list[str] | None = None) -> int:
    """`nanopipe serve [MODEL] ...`, `nanopipe bench|profile NAME ...`, `nanopipe --version`."""
    argv = sys.argv[1:] if argv is None else argv
    top = OneLineParser(prog="nanopipe", description="nanopipe: a small, fast LLM "
                        "inference engine built as a multiprocess actor pipeline.")
    top.add_argument("--version", action="version", version=f"nanopipe {package_version()}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="serve a model (nanopipe serve --help)", add_help=False)
    for name, what in (("bench", "measure a workload"), ("profile", "see where time goes")):
        commands.add_parser(name, help=f"{what} (nanopipe {name} --help)", add_help=False)
    if argv and argv[0] in ("bench", "profile"):  # the benchmark tool, imported only here
        from frontend.bench.cli import run_command
        return run_command(argv[0], argv[1:])
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        hint = closest(argv[0], COMMANDS)
        top.error(f"unknown command {argv[0]!r}" + (f" (did you mean {hint}?)" if hint else ""))
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv)  # --help, --version, or an error naming the flag
        top.print_help()
        return EXIT_USAGE
    return serve(parse_serve_args(argv[1:]))


def launch_main(argv: list[str] | None = None) -> int:
    """`scripts/launch.sh ...` and `python -m frontend.engine.cli ...`: `nanopipe serve` flags."""
    return serve(parse_serve_args(argv, prog="launch.sh"))


if __name__ == "__main__":
    sys.exit(launch_main())
