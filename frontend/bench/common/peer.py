"""nano-vLLM, the peer of docs/benchmarks.md, on the same weights and workload in the same run.

It runs from a checkout (import path DIR) in a child process of its own: it sets up CUDA and
torch.distributed for its process, and nothing of it should share nanopipe's. The child reads
the workload as JSON on stdin and prints one JSON line. W1 runs the whole batch at once; W4
runs one request at a time and times each twice, to one token and to all of them: TTFT is the
first, TPOT the difference over the tokens after the first (nano-vLLM streams nothing, and it
refuses greedy sampling, so both sample at W1's temperature 0.6 with ignore_eos).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from frontend.bench.errors import BenchUsageError

_CHILD = r"""
import json, sys, time
spec = json.loads(sys.stdin.read())
from nanovllm import LLM, SamplingParams
llm = LLM(spec["model"], enforce_eager=spec["enforce_eager"], tensor_parallel_size=1,
          max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
          max_num_batched_tokens=spec["max_num_batched_tokens"])
# nano-vLLM refuses temperature 0; W1 samples at 0.6 anyway.
llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16),
             use_tqdm=False)
params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)
          for m in spec["max_tokens"]]
start = time.perf_counter()
outputs = llm.generate(spec["prompts"], params, use_tqdm=False)
elapsed = time.perf_counter() - start
produced = sum(len(o["token_ids"]) for o in outputs)
print("NANOVLLM_RESULT " + json.dumps(dict(output_tokens=produced, seconds=elapsed)), flush=True)
"""


_CHILD_LATENCY = r"""
import json, statistics, sys, time
spec = json.loads(sys.stdin.read())
from nanovllm import LLM, SamplingParams
llm = LLM(spec["model"], enforce_eager=spec["enforce_eager"], tensor_parallel_size=1,
          max_model_len=spec["max_model_len"], max_num_seqs=1,
          max_num_batched_tokens=spec["max_model_len"])
def timed(prompt, n):
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - start
timed(spec["warm"], spec["max_tokens"])
m = spec["max_tokens"]
ttft = [timed(p, 1) for p in spec["prompts"]]
full = [timed(p, m) for p in spec["prompts"]]
# Medians first, then their difference: less noise than a difference per pair of runs.
tpot = (statistics.median(full) - statistics.median(ttft)) / (m - 1)
print("NANOVLLM_RESULT " + json.dumps(dict(ttft_ms=1e3 * statistics.median(ttft),
                                           tpot_ms=1e3 * tpot)), flush=True)
"""


def check_checkout(path: str) -> Path:
    """The checkout directory, refused with a clear message if it does not hold nanovllm."""
    root = Path(path).expanduser().resolve()
    if not (root / "nanovllm" / "llm.py").is_file():
        raise BenchUsageError(f"--peer nano-vllm {path}: no nanovllm/llm.py there (give a "
                              "nano-vLLM checkout, the directory that holds the nanovllm package)")
    return root


def run_nano_vllm(checkout: Path, model_dir: str, work, max_model_len: int, max_num_seqs: int,
                  max_num_batched_tokens: int, enforce_eager: bool,
                  timeout_s: float = 1800) -> dict:
    """W1 through nano-vLLM: {output_tokens, seconds, output_tok_s}."""
    spec = dict(model=model_dir, enforce_eager=enforce_eager, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                prompts=[p for p, _ in work], max_tokens=[m for _, m in work])
    result = _child(checkout, _CHILD, spec, timeout_s)
    result["output_tok_s"] = round(result["output_tokens"] / result["seconds"], 1)
    result["seconds"] = round(result["seconds"], 3)
    return result


def run_nano_vllm_latency(checkout: Path, model_dir: str, prompts: list[list[int]],
                          warm: list[int], max_tokens: int, enforce_eager: bool,
                          timeout_s: float = 1800) -> dict:
    """W4 through nano-vLLM, one request at a time: {ttft_ms, tpot_ms}, medians."""
    spec = dict(model=model_dir, enforce_eager=enforce_eager, prompts=prompts, warm=warm,
                max_tokens=max_tokens, max_model_len=len(prompts[0]) + max_tokens)
    return _child(checkout, _CHILD_LATENCY, spec, timeout_s)


def _child(checkout: Path, code: str, spec: dict, timeout_s: float) -> dict:
    """Run `code` with the checkout first on the import path; its NANOVLLM_RESULT line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("NANOVLLM_RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"nano-vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])
