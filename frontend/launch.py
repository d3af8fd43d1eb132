"""`python -m frontend.launch`: run a whole pipeline in the foreground until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys

from frontend.config import EngineConfig
from frontend.launcher import Pipeline, StartupError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanopipe", description=__doc__)
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--attention-backend", default="auto",
                   choices=("auto", "flash_attn", "triton", "torch"))
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-overlap", action="store_true",
                   help="wait for each step's result before planning the next")
    p.add_argument("--worker-lookahead", action="store_true",
                   help="workers launch the next step before the current step's tokens reach "
                        "the host (with overlap)")
    p.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface of the public socket with --transport tcp")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--stdout", action="store_true",
                   help="print every request's text to stdout as it is generated")
    p.add_argument("--http", type=int, default=None, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API on this port")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--api-key", default=None)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, tensor_parallel_size=args.tp, device=args.device, dtype=args.dtype,
        max_model_len=args.max_model_len, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=args.kv_cache_bytes,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
        enable_prefix_caching=not args.no_prefix_caching, overlap=not args.no_overlap,
        worker_lookahead=args.worker_lookahead,
        transport=args.transport, host=args.host, port=args.port, stdout=args.stdout,
    )


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Installed before anything starts, so a SIGTERM during start-up still stops everything.
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    pipeline = Pipeline(config_from_args(args))
    try:
        pipeline.start()
        print(f"nanopipe ready: {pipeline.config.model_name} on {pipeline.config.resolved_device}"
              f" (tp={args.tp}, {pipeline.num_kv_blocks} KV blocks)", flush=True)
        print(f"clients connect to: {pipeline.address}", flush=True)
        print(f"attach a detokenizer: python -m frontend.stdout_detokenizer "
              f"--model {pipeline.config.model_dir} {pipeline.endpoints.deltas_pub}", flush=True)
        if args.http is not None:
            from frontend.http_server import serve

            print(f"HTTP API: http://{args.http_host}:{args.http}/v1", flush=True)
            serve(pipeline.address, host=args.http_host, port=args.http, api_key=args.api_key)
        else:
            while not pipeline.wait(timeout=1.0):
                pass
            print(f"nanopipe: engine dead: {pipeline.dead_reason}", file=sys.stderr, flush=True)
            return 1
    except StartupError as exc:
        print(f"nanopipe: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("nanopipe: stopping", file=sys.stderr, flush=True)
    finally:
        pipeline.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
