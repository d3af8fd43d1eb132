"""The one-shot all-reduce through peer memory (gpu_workers.layers.peer_all_reduce) sums what
NCCL sums, bitwise, on every rank, in eager mode and replayed from a CUDA graph; tensors larger
than its buffer go to NCCL. Its kernels count as collectives in the ranks' profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gpu_workers.profiling.rank_profile import _kind
from gpu_workers.profiling.summary import COLLECTIVE, categorize

ONE_SHOT_KERNEL = (
    "void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>"
    "(c10::BFloat16**, c10::BFloat16*, c10::BFloat16*, unsigned long, unsigned long, "
    "unsigned int**, unsigned long, unsigned long)")


def test_one_shot_kernels_and_ops_are_collectives_in_profiles():
    for name in (ONE_SHOT_KERNEL, "symm_mem::one_shot_all_reduce_copy_out"):
        assert COLLECTIVE.match(name) and categorize(name) == "collectives", name
    assert _kind(ONE_SHOT_KERNEL) == "one_shot_all_reduce"
    assert _kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "all_reduce"
    assert not COLLECTIVE.match("void at::native::vectorized_elementwise_kernel<4>")


def test_cpu_ranks_keep_the_process_group(tmp_path):
    """gloo on the CPU: no peer memory, all_reduce still sums (through the process group)."""
    mp.start_processes(_cpu_rank, args=(str(tmp_path),), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {"peers": None, "sum": [1.0, 3.0]}


def _cpu_rank(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from gpu_workers.layers.parallel import TPInfo
    from gpu_workers.layers.peer_all_reduce import create_peer_all_reduce

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank,
                            world_size=2)
    peers = create_peer_all_reduce(torch.float32, torch.device("cpu"))
    total = TPInfo(rank, 2, peers).all_reduce(torch.tensor([0.0, 1.0]) + rank)
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"peers": None if peers is None else "set", "sum": total.tolist()}))
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(300)
def test_one_shot_sums_equal_nccl_on_two_gpus(tmp_path):
    mp.start_processes(_gpu_rank, args=(str(tmp_path),), nprocs=2, join=True,
                       start_method="spawn")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["peers"], "two GPUs of one host must get the peer all-reduce"
        assert all(report["equal_nccl"].values()), report["equal_nccl"]
        assert report["graph_equal_nccl"]
    assert reports[0]["digests"] == reports[1]["digests"]  # the ranks' sums are bitwise equal


def _gpu_rank(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from gpu_workers.layers.parallel import TPInfo
    from gpu_workers.layers.peer_all_reduce import create_peer_all_reduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{out_dir}/init", rank=rank,
                            world_size=2)
    device = torch.device("cuda", rank)
    peers = create_peer_all_reduce(torch.bfloat16, device, max_bytes=1 << 20)
    tp = TPInfo(rank, 2, peers)
    gen = torch.Generator(device).manual_seed(rank)
    equal, digests = {}, {}
    # One row, a decode batch, the whole buffer, and one past it (NCCL's).
    for rows in (1, 37, 128, 129):
        x = torch.randn(rows, 4096, generator=gen, device=device).to(torch.bfloat16)
        reference = x.clone()
        dist.all_reduce(reference)
        got = tp.all_reduce(x.clone())
        equal[rows] = bool(torch.equal(got, reference))
        digests[rows] = float(got.float().abs().sum())

    # Captured once, replayed on new inputs: the decode graphs' use.
    static_in = torch.zeros(64, 4096, dtype=torch.bfloat16, device=device)
    tp.all_reduce(static_in.clone())  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = tp.all_reduce(static_in.clone())
    graph_equal = True
    for _ in range(3):
        static_in.copy_(torch.randn(64, 4096, generator=gen, device=device))
        graph.replay()
        reference = static_in.clone()
        dist.all_reduce(reference)
        graph_equal &= bool(torch.equal(static_out, reference))
    torch.cuda.synchronize()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(dict(
        peers=peers is not None, equal_nccl={str(k): v for k, v in equal.items()},
        graph_equal_nccl=graph_equal, digests={str(k): v for k, v in digests.items()})))
    dist.destroy_process_group()
