"""What an fp8 KV cache costs in accuracy: the same greedy requests with the KV cache in the
model's dtype (--kv-cache-dtype auto) and in fp8, compared token by token.

    nanopipe bench kv-accuracy --device cpu                 # the embedded SmolLM2
    nanopipe bench kv-accuracy --model DIR --device cuda --new-tokens 128

The prompts are W5's chat questions (--num-prompts of them, in the model's chat template),
each decoded greedily for --new-tokens tokens with ignore_eos, through frontend.LLM, one
engine at a time. Figures:

- agree_until_first_diff: the share of generated positions that come before their request's
  first differing token (a request that never differs counts all its positions);
- agree_overall: the share of positions holding the same token, wherever they are;
- mean_abs_logprob_diff: the mean |logprob_fp8 - logprob_auto| of the chosen token over the
  positions before the first difference (there both runs saw the same context and chose the
  same token, so the two numbers measure the same thing);
- prompts_identical: the share of requests whose tokens are all equal;
- kv_blocks_ratio: the fp8 pool's blocks over the auto pool's, from the same memory.

For scale, --reference-dtype D also compares the auto run with one whose weights and KV are
in D (no fp8), printed and recorded as the same figures with a "[D]" suffix: how far a change
of the model's dtype alone moves the same requests (e.g. --dtype bfloat16 --reference-dtype
float32: what bf16 rounding costs next to what fp8 KV costs).
"""

from __future__ import annotations

import argparse
import datetime as dt

from frontend import LLM, SamplingParams
from frontend.bench.common.chat_prompts import QUESTIONS, chat_prompts
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure

MODEL = "optional"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--new-tokens", type=int, default=64,
                    help="greedy tokens per request (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=len(QUESTIONS),
                    help="chat questions to run, at most %(default)s (default: all)")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="the model's dtype, and the auto KV cache's (default: the checkpoint's)")
    ap.add_argument("--reference-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="also compare the auto run with the model in this dtype (no fp8): "
                         "the drift of a dtype change alone, for scale")


def compare(auto: list[dict], fp8: list[dict]) -> dict[str, float]:
    """The figures of the module docstring from two runs' results, request by request."""
    until = same = total = identical = 0
    diffs: list[float] = []
    for a, b in zip(auto, fp8, strict=True):
        ta, tb = a["token_ids"], b["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        until, total = until + first, total + len(ta)
        same += sum(x == y for x, y in zip(ta, tb))
        identical += first == len(ta) == len(tb)
        diffs += [abs(x - y) for x, y in zip(a["logprobs"][:first], b["logprobs"][:first])]
    return {"agree_until_first_diff": until / total, "agree_overall": same / total,
            "mean_abs_logprob_diff": sum(diffs) / max(len(diffs), 1),
            "prompts_identical": identical / len(auto)}


def _generate(model_dir: str, kv: str, prompts: list[list[int]], args,
              dtype: str | None = None) -> tuple[list, int]:
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True,
                            logprobs=True)
    with LLM(model_dir, device=args.device, dtype=dtype or args.dtype, kv_cache_dtype=kv,
             max_model_len=max(map(len, prompts)) + args.new_tokens,
             max_num_seqs=len(prompts)) as llm:
        outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        return outs, llm.pipeline.num_kv_blocks


def run(args: argparse.Namespace) -> list[Figure]:
    if not 1 <= args.num_prompts <= len(QUESTIONS) or args.new_tokens < 1:
        raise BenchUsageError(f"--num-prompts must be in 1..{len(QUESTIONS)} and "
                              "--new-tokens >= 1")
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(args, args.device, tokenizer=True)
    if model_dir is None:
        from frontend.embedded_model import default_model_dir

        model_dir = default_model_dir()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir),
                           QUESTIONS[:args.num_prompts])
    print(f"kv-accuracy {dt.datetime.now().astimezone().isoformat(timespec='seconds')}: "
          f"{model_dir} on {args.device}, dtype {args.dtype or 'of the checkpoint'}; "
          f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.new_tokens} greedy tokens each", flush=True)
    auto, auto_blocks = _generate(model_dir, "auto", prompts, args)
    fp8, fp8_blocks = _generate(model_dir, "fp8", prompts, args)
    out = _agreement(compare(auto, fp8), "")
    out.append(Figure("kv_blocks_ratio", fp8_blocks / auto_blocks, "x"))
    if args.reference_dtype:
        reference, _ = _generate(model_dir, "auto", prompts, args, args.reference_dtype)
        out += _agreement(compare(auto, reference), f"[{args.reference_dtype}]")
    return out


def _agreement(figures: dict[str, float], suffix: str) -> list[Figure]:
    return [Figure("agree_until_first_diff" + suffix, figures["agree_until_first_diff"],
                   "share"),
            Figure("agree_overall" + suffix, figures["agree_overall"], "share"),
            Figure("mean_abs_logprob_diff" + suffix, figures["mean_abs_logprob_diff"], "nats",
                   higher_is_better=False),
            Figure("prompts_identical" + suffix, figures["prompts_identical"], "share")]
