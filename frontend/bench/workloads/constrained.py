"""Structured outputs' cost: a W1-shaped batch where every request has a JSON schema, against
the same batch unconstrained, in the same run; and the time the token mask takes per step.

    nanopipe bench constrained --make-random qwen3-0.6b                      # on a GPU
    nanopipe bench constrained --model DIR --device cpu --num-seqs 16 \\
        --max-input-len 64 --max-output-len 64                               # CPU run

A grammar ends its request (EOS) where the schema is complete, so the two batches could not
be compared by W1's fixed lengths: the constrained batch runs first, and the unconstrained one
then asks each request for exactly the tokens its constrained twin produced (ignore_eos), so
both batches do the same work but for the masks. Temperature 0.6 as W1.

The mask time per step is measured in this process on the same device: GrammarBook (the
worker's own code) fills and applies the bitmask of B constrained rows of [B, vocab] logits
in the model's dtype, then each row's matcher accepts the token sampled under it, for B in
--mask-batches; a steady-state mean (the first step of each size is printed apart). On a GPU
the fill and copy are those of a decode step, into the decode graphs' bitmask
(gpu_workers.graph_bitmask), and the apply the graph's, here launched eagerly.

--make-random writes a tokenizer that can spell JSON (every printable ASCII character is a
token of its own, the rest of the vocabulary random lowercase words): the usual synthetic one
names ids "t0", "t1", ... and no grammar could be spelt with it.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from frontend.bench.common import w1_workload
from frontend.bench.common.model_source import add_w1_shape, resolve_model_dir
from frontend.bench.figures import Figure

MODEL = "required"
HEADLINE = "constrained_ratio"
WARMUP_STEPS = 3
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "rating": {"type": "integer", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["title", "rating", "tags", "summary"],
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_w1_shape(ap)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="KV cache size (default: sized from free memory)")
    ap.add_argument("--mask-batches", default="1,64,256",
                    help="batch sizes of the mask-time measurement (default: %(default)s)")
    ap.add_argument("--mask-steps", type=int, default=50,
                    help="steps timed per mask batch size (default: %(default)s)")


def write_json_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose tokens are raw strings: every printable ASCII character
    (and a newline) alone, then random lowercase words; decoding concatenates them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0}
    for ch in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab.setdefault(ch, len(vocab))
    rng = random.Random(0)
    while len(vocab) < vocab_size:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # prompts travel as ids: never used
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")
    fast.save_pretrained(model_dir)


def _llm(model_dir: str, args: argparse.Namespace):
    from frontend import LLM

    return LLM(model_dir, device=args.device, max_num_seqs=args.max_num_seqs,
               max_model_len=args.max_input_len + args.max_output_len,
               max_num_batched_tokens=args.max_num_batched_tokens,
               enforce_eager=args.enforce_eager, kv_cache_bytes=args.kv_cache_bytes)


def run_batches(model_dir: str, args: argparse.Namespace, work) -> dict:
    """Both batches through one pipeline: constrained, then unconstrained with its lengths."""
    from protocol import SamplingParams

    prompts = [p for p, _ in work]
    spec = {"json": SCHEMA}
    llm = _llm(model_dir, args)
    try:
        llm.generate([prompts[0][:8]], SamplingParams(temperature=0.6, max_tokens=16,
                                                      structured_outputs=spec), use_tqdm=False)
        start = time.perf_counter()
        constrained = llm.generate(prompts, [SamplingParams(
            temperature=0.6, max_tokens=m, structured_outputs=spec) for _, m in work],
            use_tqdm=False)
        t_constrained = time.perf_counter() - start
        lengths = [len(o["token_ids"]) for o in constrained]
        start = time.perf_counter()
        free = llm.generate(prompts, [SamplingParams(temperature=0.6, max_tokens=n,
                                                     ignore_eos=True) for n in lengths],
                            use_tqdm=False)
        t_free = time.perf_counter() - start
    finally:
        llm.close()
    produced = sum(lengths)
    assert produced == sum(len(o["token_ids"]) for o in free), "the batches differ in work"
    parsed = sum(_parses(o["text"]) for o in constrained if o["finish_reason"] == "stop")
    return dict(output_tokens=produced, mean_output_len=round(produced / len(work), 1),
                constrained_s=round(t_constrained, 3), unconstrained_s=round(t_free, 3),
                constrained_tok_s=round(produced / t_constrained, 1),
                unconstrained_tok_s=round(produced / t_free, 1),
                ratio=round(t_free / t_constrained, 4),
                finished_by_grammar=sum(o["finish_reason"] == "stop" for o in constrained),
                parsed=parsed)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def mask_times(model_dir: str, device: str, batches: list[int], steps: int,
               in_graph: bool | None = None) -> dict[int, float]:
    """Milliseconds per step to fill, copy and apply the bitmask of B rows and advance their
    matchers, on `device` (synchronized: the whole cost a step pays before sampling), in
    steady state: the apply kernel is warmed as the worker warms it at start-up, and each
    size's first steps (its buffers, its matchers' first masks) are left out of the mean.
    in_graph (default: on CUDA, where decode steps sample in graphs): through the decode
    graphs' bitmask, else the eager path's."""
    import numpy as np
    import torch

    from gpu_workers import ModelConfig
    from gpu_workers.grammar_book import GrammarBook
    from gpu_workers.graph_bitmask import GraphBitmask, apply_rows
    from protocol.structured_outputs import structured_from_user

    mc = ModelConfig.from_dir(model_dir)
    vocab = mc.vocab_size
    book = GrammarBook(model_dir, vocab)
    spec = structured_from_user({"json": SCHEMA})
    book.compiled(spec).result()
    book.bitmask.warm_up(torch.device(device), mc.dtype, vocab)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    in_graph = device == "cuda" if in_graph is None else in_graph
    graph = GraphBitmask(max(batches), vocab, torch.device(device)) if in_graph else None
    out = {}
    for b in batches:
        rows, epochs = np.arange(b), np.full(b, 7)
        on = np.ones(b, bool)
        for r in range(b):
            book.add(r, 7, spec, [])
        total = 0.0
        for step in range(steps + WARMUP_STEPS):
            logits = torch.randn(b, vocab, device=device, generator=gen).to(mc.dtype)
            sync()
            start = time.perf_counter()
            if graph is None:
                book.mask_logits(logits, rows, epochs, on)
            else:
                book.fill_graph_rows(graph, b, rows, epochs, on)
                apply_rows(logits, graph.rows[:b], graph.indices(b), vocab)
            tokens = logits.argmax(dim=-1).cpu().numpy()
            book.accept(rows, epochs, tokens, on)
            sync()
            if step == 0:
                print(f"mask at batch {b}, first step: "
                      f"{1e3 * (time.perf_counter() - start):.3f} ms", flush=True)
            if step >= WARMUP_STEPS:
                total += time.perf_counter() - start
        out[b] = 1e3 * total / steps
    return out


def run(args: argparse.Namespace) -> list[Figure]:
    from gpu_workers import ModelConfig

    model_dir = resolve_model_dir(args, args.device, tokenizer=True)
    mc = ModelConfig.from_dir(model_dir)
    if getattr(args, "make_random", None):
        write_json_tokenizer(Path(model_dir), mc.vocab_size)
    work = w1_workload(args.num_seqs, args.max_input_len, args.max_output_len, mc.vocab_size)
    batches = [int(b) for b in args.mask_batches.split(",") if b]
    masks = mask_times(model_dir, args.device, batches, args.mask_steps)
    for b, ms in masks.items():
        print(f"mask per step at batch {b}: {ms:.3f} ms (fill + copy + apply + accept)",
              flush=True)
    result = run_batches(model_dir, args, work)
    result["mask_ms_per_step"] = {str(b): round(ms, 3) for b, ms in masks.items()}
    print(json.dumps(result), flush=True)
    print(f"constrained {result['constrained_tok_s']:.1f} tok/s vs unconstrained "
          f"{result['unconstrained_tok_s']:.1f} tok/s, same {result['output_tokens']} tokens "
          f"(mean {result['mean_output_len']} per request): ratio {result['ratio']:.3f}; "
          f"{result['finished_by_grammar']}/{len(work)} ended by their grammar, "
          f"{result['parsed']} of those parse", flush=True)
    figures = [Figure(HEADLINE, result["ratio"], "x"),
               Figure("constrained_tok_s", result["constrained_tok_s"], "tok/s"),
               Figure("unconstrained_tok_s", result["unconstrained_tok_s"], "tok/s")]
    figures += [Figure(f"mask_ms@{b}", round(ms, 3), "ms", higher_is_better=False)
                for b, ms in masks.items()]
    return figures
