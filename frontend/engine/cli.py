"""The command line: `nanopipe serve [MODEL]` (and `scripts/launch.sh`, the same flags).

It runs a whole pipeline in the foreground until Ctrl-C or SIGTERM, printing what start-up
is doing. Clients reach it over ZeroMQ at the printed address, and over the
OpenAI-compatible HTTP API on 127.0.0.1:8000 (`--port`, `--host`; `--no-http` serves none);
Prometheus scrapes its metrics at the HTTP server's /metrics, or at `--metrics-port`. Every
check that needs no process (model path, device, tensor-parallel size, ports) is made before
anything starts, and a wrong one is a one-line error. Exit statuses: frontend/engine/usage.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import signal
import socket
import sys
from dataclasses import Field, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from frontend.engine.config import EngineConfig
from frontend.engine.log_config import configure_logging
from frontend.engine.options import (
    ConfigError,
    Option,
    check_options,
    described_fields,
    flags_of,
    option,
)
from frontend.engine.pipeline import Pipeline
from frontend.engine.preflight import check_port_free, warn_if_exposed
from frontend.engine.startup import StartupError
from frontend.engine.stop_signal import StopSignal
from frontend.engine.usage import (
    EXIT_FAILED,
    EXIT_STOPPED,
    EXIT_USAGE,
    OneLineParser,
    closest,
)

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_HTTP_PORT = 8000
"""vLLM's: `nanopipe serve MODEL` answers where `vllm serve MODEL` would."""
DEVICE_FLAGS = {"gpu_memory_utilization": "cuda", "enforce_eager": "cuda",
                "kv_cache_bytes": "cpu"}
"""Engine fields that only one device reads: given for the other, they would be ignored."""


def package_version() -> str:
    try:
        return version("nanopipe")
    except PackageNotFoundError:
        return "unknown (not installed)"


class UsageError(ValueError):
    """A flag that contradicts another, or that would be silently ignored."""


@dataclass(frozen=True)
class HttpConfig:
    """What `nanopipe serve` adds to the engine: the OpenAI-compatible HTTP API, and logging."""

    port: int = option(
        DEFAULT_HTTP_PORT, "serve /v1/completions, /v1/chat/completions, /v1/models and "
        "/health on this port", flags=("--port", "--http"), minimum=1, maximum=65535,
        group="http")
    serve_http: bool = option(True, "serve no HTTP API: clients connect over ZeroMQ only",
                              flags=("--no-http",), group="http")
    host: str = option("127.0.0.1", "interface of the HTTP server", flags=("--host",),
                       group="http")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY'", group="http")
    max_request_bytes: int | None = option(
        None, "larger request bodies get 413 before they are read (default: 64 bytes per token "
        "of max-model-len, plus 1 MiB)", minimum=1, group="http")
    log_level: str = option("info", "what the launcher and the HTTP server log",
                            choices=LOG_LEVELS, group="")
    metrics_port: int | None = option(
        None, "serve Prometheus metrics at /metrics on this port (with --port they are also "
        "on the HTTP server's /metrics)", minimum=1, maximum=65535, group="metrics")
    metrics_host: str = option("127.0.0.1", "interface of the metrics port", group="metrics")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class ServeCommand:
    """A parsed `nanopipe serve` command line."""

    engine: EngineConfig
    http: HttpConfig


_GROUPS = {
    "engine": "engine",
    "zmq": "ZeroMQ client API",
    "http": "OpenAI-compatible HTTP API (on 127.0.0.1:8000 unless --no-http)",
    "metrics": "Prometheus metrics",
}
_CONFIGS = {"engine": EngineConfig, "http": HttpConfig}
"""Prefix of a flag's argparse dest -> the config class whose field it sets."""


def _help(f: Field, opt: Option, typ: type) -> str:
    if typ is bool or "default" in opt.help:
        return opt.help
    if f.default is None:
        return f"{opt.help} (default: {opt.auto})" if opt.auto else opt.help
    return f"{opt.help} (default: {f.default})"


def _add_options(p: argparse.ArgumentParser, prefix: str, cls: type,
                 groups: dict[str, argparse._ArgumentGroup]) -> None:
    """One flag per described field of `cls`; its dest is `prefix.field`, absent unless given."""
    for f, opt, typ in described_fields(cls):
        where = groups.get(opt.group, p)
        kw: dict[str, Any] = {"dest": f"{prefix}.{f.name}", "default": argparse.SUPPRESS,
                              "help": _help(f, opt, typ)}
        if typ is bool:
            kw.update(action="store_const", const=not f.default)
        elif opt.choices is not None:
            kw["choices"] = ((opt.auto,) if opt.auto else ()) + tuple(opt.choices)
        else:
            kw["metavar"] = opt.metavar or flags_of(opt, f.name)[0][2:].upper().replace("-", "_")
            if typ in (int, float):
                kw["type"] = opt.number_type(typ)
        where.add_argument(*flags_of(opt, f.name), **kw)


def build_serve_parser(prog: str = "nanopipe serve") -> argparse.ArgumentParser:
    """The flags of `nanopipe serve`, generated from EngineConfig's and HttpConfig's fields."""
    p = OneLineParser(
        prog=prog, description="Serve a model with a nanopipe pipeline until Ctrl-C or SIGTERM.")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="same as --model MODEL")
    p.add_argument("--version", action="version", version=f"nanopipe {package_version()}")
    groups = {key: p.add_argument_group(title) for key, title in _GROUPS.items()}
    for prefix, cls in _CONFIGS.items():
        _add_options(p, prefix, cls, groups)
    return p


def _given(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The fields of one config that the command line set, with "auto" words made None."""
    cls = _CONFIGS[prefix]
    autos = {f.name: opt.auto for f, opt, _ in described_fields(cls)}
    out = {}
    for dest, value in vars(args).items():
        owner, _, name = dest.partition(".")
        if owner == prefix:
            out[name] = None if value is not None and value == autos[name] else value
    return out


def flag_for(prefix: str, name: str) -> str:
    """The main flag of field `name` of config `prefix` ("engine" or "http")."""
    opt = next(o for f, o, _ in described_fields(_CONFIGS[prefix]) if f.name == name)
    return flags_of(opt, name)[0]


def parse_serve_args(argv: list[str] | None, prog: str = "nanopipe serve") -> ServeCommand:
    """The command line as configs; a usage error (exit 2) names the flag at fault."""
    parser = build_serve_parser(prog)
    args = parser.parse_args(argv)
    engine, http = _given(args, "engine"), _given(args, "http")
    try:
        if args.model_path is not None:
            if "model" in engine:
                raise UsageError("give the model either as MODEL or as --model, not both")
            engine["model"] = args.model_path
        check_flags(engine, http)
        config = _build(EngineConfig, "engine", engine)
        check_device_flags(config, engine)
        return ServeCommand(config, _build(HttpConfig, "http", http))
    except UsageError as exc:
        parser.error(str(exc))


def _build(cls: type, prefix: str, values: dict[str, Any]) -> Any:
    try:
        return cls(**values)
    except ConfigError as exc:
        raise UsageError(f"{flag_for(prefix, exc.field)} {exc.problem}") from None


def check_flags(engine: dict[str, Any], http: dict[str, Any]) -> None:
    """Refuse flags that would be ignored: HTTP ones with --no-http, tcp ones with ipc."""
    if http.get("serve_http") is False:
        for name in ("port", "host", "api_key", "max_request_bytes"):
            if name in http:
                raise UsageError(f"{flag_for('http', name)} applies to the HTTP API, which "
                                 f"{flag_for('http', 'serve_http')} turns off")
    if "metrics_host" in http and "metrics_port" not in http:
        raise UsageError(f"{flag_for('http', 'metrics_host')} applies to "
                         f"{flag_for('http', 'metrics_port')}: add it")
    if "metrics_port" in http and http.get("port") == http["metrics_port"]:
        raise UsageError(f"{flag_for('http', 'metrics_port')} is the HTTP port, which serves "
                         "/metrics already: leave it out, or give another port")
    for name, kinds in (("num_speculative_tokens", ("ngram", "draft")), ("ngram_size", ("ngram",))):
        if name in engine and engine.get("speculative") not in kinds:
            raise UsageError(f"{flag_for('engine', name)} applies to "
                             f"{flag_for('engine', 'speculative')} {' or '.join(kinds)}")
    if engine.get("node_rank", 0) > 0 and "port" in http:
        raise UsageError(f"{flag_for('http', 'port')} applies to node 0, which runs the front")
    transport = engine.get("transport", _default(EngineConfig, "transport"))
    if transport == "ipc":
        for name in ("host", "port"):
            if name in engine:
                raise UsageError(f"{flag_for('engine', name)} applies to "
                                 f"{flag_for('engine', 'transport')} tcp")


def check_device_flags(config: EngineConfig, given: dict[str, Any]) -> None:
    """Refuse a flag that only the other device reads (the device resolved, auto included)."""
    for name, device in DEVICE_FLAGS.items():
        if name in given and config.resolved_device != device:
            raise UsageError(f"{flag_for('engine', name)} applies to --device {device}; this "
                             f"engine runs on {config.resolved_device}")


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def print_progress(text: str) -> None:
    """What start-up is doing, on stderr (stdout carries the addresses users copy)."""
    print(f"nanopipe: {text}", file=sys.stderr, flush=True)


def _bind_http(host: str, port: int) -> socket.socket:
    """Take the HTTP port before the engine starts: a taken port fails in one line, at once."""
    check_port_free(host, port, "the HTTP")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


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

        metrics = EngineMetrics()
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
        if metrics is not None:  # every replica publishes its own stats
            stats_subs = [StatsSubscriber(r.deltas_pub, pipeline.endpoints.keys,
                                          functools.partial(metrics.update, source=i))
                          for i, r in enumerate(pipeline.replicas)]
        print(f"nanopipe ready: {config.model_name} on {config.resolved_device}"
              f" (tp={config.tensor_parallel_size}"
              f"{f', dp={config.data_parallel_size}' if config.data_parallel_size > 1 else ''}"
              f", {pipeline.num_kv_blocks} KV blocks)",
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
            serve_http(pipeline.address, sock=http_sock, api_key=http.api_key,
                       model_name=config.served_model_name, log_level=http.log_level,
                       max_request_bytes=http.max_request_bytes,
                       engine_alive=lambda: pipeline.dead_reason is None, metrics=metrics,
                       degraded=lambda: pipeline.degraded)
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
