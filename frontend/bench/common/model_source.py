"""The command-line options the workloads share, and the model directory they name.

Every workload that runs a model takes it either as --model DIR or as --make-random SHAPE
(random weights of a real shape, built on the device), and the W1 workloads take the same
workload and batching options; one definition keeps their flags, defaults and help alike.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import shutil
import tempfile
import time
from pathlib import Path

from frontend.bench.common.random_model import SHAPES, make_random
from protocol.limits import KV_CACHE_DTYPES
from protocol.model_config import has_model_config


def add_model_source(ap: argparse.ArgumentParser, *, required: bool = True,
                     device_default: str | None = None, out: bool = False,
                     model_help: str = "a Hugging Face model directory") -> None:
    """--model DIR or --make-random SHAPE (one of them when `required`; else neither means
    the workload's own default model), --out DIR where `out` (where --make-random writes),
    and --device with the workload's default (None: cuda when visible)."""
    src = ap.add_mutually_exclusive_group(required=required)
    src.add_argument("--model", help=model_help if required
                     else f"{model_help} (default: embedded model)")
    src.add_argument("--make-random", choices=sorted(SHAPES),
                     help="random bf16 weights of this shape, built on the device")
    if out:
        ap.add_argument("--out", help="where --make-random writes (default: a temp dir)")
    ap.add_argument("--device", default=device_default,
                    help="cuda or cpu (default: cuda when visible)" if device_default is None
                    else "cuda or cpu (default: %(default)s)")


def add_w1_shape(ap: argparse.ArgumentParser, *, batched_tokens: bool = True) -> None:
    """W1's size (docs/benchmarks.md: the defaults are the workload itself) and the batching limits
    it runs under; `batched_tokens=False` leaves out --max-num-batched-tokens."""
    ap.add_argument("--num-seqs", type=int, default=256,
                    help="W1 sequences (default: %(default)s)")
    ap.add_argument("--max-input-len", type=int, default=1024,
                    help="W1 prompt lengths are randint(100, this) (default: %(default)s)")
    ap.add_argument("--max-output-len", type=int, default=1024,
                    help="W1 output lengths are randint(100, this) (default: %(default)s)")
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="sequences in one step at most (default: %(default)s)")
    if batched_tokens:
        ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                        help="tokens in one step at most (default: %(default)s)")


def add_kv_cache_dtype(ap: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype as `nanopipe serve` takes it."""
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="what the KV cache stores: auto (the model's dtype) or fp8 "
                    "(default: %(default)s)")


def add_plans_ahead(ap: argparse.ArgumentParser) -> None:
    """--plans-ahead as the engine takes it: auto (its default), 1 or 2; None for auto."""
    ap.add_argument("--plans-ahead", type=lambda v: None if v == "auto" else int(v),
                    default=None, choices=(None, 1, 2), metavar="{auto,1,2}",
                    help="steps the pipeline's scheduler plans ahead of the results (default "
                    "auto: the engine's choice; 2 needs worker lookahead)")


def resolve_model_dir(args: argparse.Namespace, device: str, out: str | Path | None = None,
                      tokenizer: bool = False) -> str | None:
    """The model directory the arguments name: --model as given (None when neither flag was
    given; a directory without config.json ends the run with one line saying so), or,
    with --make-random, random weights built on `device` into `out` (default: a new temp dir
    nanopipe-SHAPE-..., removed when the process exits: random weights of the 8B shape fill
    16 GB), with a synthetic tokenizer when `tokenizer`. On cuda the allocator's cache is
    emptied after the build: engines size their KV cache from the free memory. A
    --max-model-len beyond the shape's own limit raises the random config's to it."""
    shape = args.make_random
    if not shape:
        if args.model is not None and not has_model_config(args.model):
            raise SystemExit(f"--model {args.model}: no config.json there "
                             "(a Hugging Face model directory is expected)")
        return args.model
    temp = out is None
    target = Path(tempfile.mkdtemp(prefix=f"nanopipe-{shape}-")) if temp else Path(out)
    if temp:
        atexit.register(shutil.rmtree, target, ignore_errors=True)
    t0 = time.perf_counter()
    longest = getattr(args, "max_model_len", None)
    make_random(shape, target, device, tokenizer=tokenizer, max_positions=longest)
    limit = SHAPES[shape]["max_position_embeddings"]
    if longest is not None and longest > limit:
        print(f"random {shape}: max_position_embeddings raised from {limit} to {longest} "
              "for --max-model-len (the weights are random; the speed does not depend on it)",
              flush=True)
    if device == "cuda":
        import torch

        gc.collect()
        torch.cuda.empty_cache()
    print(f"random {shape} weights built in {time.perf_counter() - t0:.1f} s at {target}",
          flush=True)
    return str(target)
