"""The flags of `nanopipe serve` (and `scripts/launch.sh`): generated from EngineConfig's and
HttpConfig's fields, parsed into a ServeCommand, and checked for flags that contradict or
would be ignored, each refusal one line naming the flag (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import Field, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from frontend.engine.config import EngineConfig
from frontend.engine.options import (
    ConfigError,
    Option,
    check_options,
    described_fields,
    flags_of,
    option,
)
from frontend.engine.usage import OneLineParser
from protocol.reasoning import PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_HTTP_PORT = 8000
"""vLLM's: `nanopipe serve MODEL` answers where `vllm serve MODEL` would."""
DEVICE_FLAGS = {"gpu_memory_utilization": "cuda", "enforce_eager": "cuda",
                "precompile_kernels": "cuda"}
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
    reasoning_parser: str | None = option(
        None, "split a thinking model's <think> block off chat answers into reasoning_content, "
        "free of the request's constraint (qwen3: the answer may open one; deepseek_r1: the "
        "prompt opened it)", choices=PARSERS, group="http")
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
        for name in ("port", "host", "api_key", "max_request_bytes", "reasoning_parser"):
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
    for name in ("kv_transfer_timeout", "kv_transfer"):
        if name in engine and not engine.get("prefill_replicas"):
            raise UsageError(f"{flag_for('engine', name)} applies to "
                             f"{flag_for('engine', 'prefill_replicas')} and "
                             f"{flag_for('engine', 'decode_replicas')}")
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


