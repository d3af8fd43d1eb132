"""The attention kernels compile one variant for every batch shape, without a GPU.

The decode graphs capture ~35 batch sizes, whose split counts run from 1 to 64: were the
count a specialisation (an integer of 1, a multiple of 16 or neither) or the reduce's tile
sized by it, each new count would compile a variant during capture, seconds of a cold start.
Likewise an eager step's sequence count and block-table width (its longest context) change
from step to step: variants of them would be compiled, some first while serving. Triton's
variants for an H100/H200 target (sm_90) are recorded here on the CPU, launching nothing
(gpu_workers.kernel_precompile.SpecRecorder).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

RECORD = """
import collections, json
import torch
from gpu_workers.kernel_precompile import SpecRecorder, _use_target

_use_target(("cuda", 90, 32))
from kernels.paged_decode_attention import paged_decode_attention_triton

seqs, heads, kv_heads, dim, block = 32, 16, 8, 128, 16
q = torch.zeros(seqs, heads, dim, dtype=torch.bfloat16)
cache = torch.zeros(64, block, kv_heads, dim, dtype=torch.bfloat16)
tables = torch.zeros(seqs, 256, dtype=torch.int32)  # 4096 keys: up to 256 16-key tiles
lens = torch.full((seqs,), 100, dtype=torch.int32)
counts = collections.Counter()
with SpecRecorder() as recorder:
    for splits in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 48, 64):
        paged_decode_attention_triton(q, cache, cache, tables, lens, 0.1, num_splits=splits)
    for n, width in ((1, 1), (16, 1), (17, 16), (3, 5), (32, 33)):  # count, table width
        for splits in (1, 2):
            paged_decode_attention_triton(q[:n], cache, cache, tables[:n, :width].clone(),
                                          lens[:n], 0.1, num_splits=splits)
for module, name, _ in recorder.specs:
    counts[name] += 1
print(json.dumps(counts))
"""

PREFILL = """
import collections, json
import torch
from gpu_workers.kernel_precompile import SpecRecorder, _use_target

_use_target(("cuda", 90, 32))
from kernels.paged_attention import paged_attention_triton

heads, kv_heads, dim, block = 16, 8, 128, 16
cache = torch.zeros(64, block, kv_heads, dim, dtype=torch.bfloat16)
counts = collections.Counter()
with SpecRecorder() as recorder:
    for n, width in ((1, 1), (1, 16), (16, 1), (17, 16), (3, 5), (32, 33), (48, 2)):
        q = torch.zeros(4 * n, heads, dim, dtype=torch.bfloat16)
        cu = torch.arange(0, 4 * n + 1, 4, dtype=torch.int32)
        paged_attention_triton(q, cache, cache, torch.zeros(n, width, dtype=torch.int32),
                               cu, torch.full((n,), 4, dtype=torch.int32), 0.1)
for module, name, _ in recorder.specs:
    counts[name] += 1
print(json.dumps(counts))
"""


def _variants(script: str, cache: Path) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_split_count_and_batch_shares_one_split_and_one_reduce_variant(tmp_path):
    # One split kernel for one split (it writes the output itself), one for any more, and
    # one reduce.
    assert _variants(RECORD, tmp_path) == {"_decode_split_kernel": 2,
                                           "_decode_reduce_kernel": 1}


def test_every_prefill_batch_shares_one_variant(tmp_path):
    assert _variants(PREFILL, tmp_path) == {"_paged_attention_kernel": 1}
