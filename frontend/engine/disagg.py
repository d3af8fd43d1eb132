"""Prefill/decode disaggregation at start-up: which settings go together, and the links each
replica's processes get (docs/disaggregation.md).

The replicas are the data-parallel machinery's (Endpoints.replica, one scheduler and --tp
workers each): the first P prefill, the next D decode. Each scheduler gets the other role's
scheduler inputs; each rank the decode replicas' transfer addresses of its own rank index
(a decode rank binds its own).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from frontend.engine import disagg_gpus
from frontend.engine.options import ConfigError
from frontend.engine.startup import replica_env
from frontend.engine.torch_build import visible_gpus
from frontend.openai_server.health import NoNewRequests
from protocol import Endpoints
from protocol.actor_start import to_plain
from protocol.endpoints import _free_ports
from protocol.kv_handoff import KVLinks

EngineConfig = Any
"""frontend.engine.config.EngineConfig, which imports this module (its checks live here)."""


def check_disaggregation(cfg: EngineConfig) -> None:
    """Refuse combinations that do not work (yet), in one line naming the field."""
    p, d = cfg.prefill_replicas, cfg.decode_replicas
    if not p and not d:
        return
    owner = "EngineConfig"
    if p < 1 or d < 1:
        field = "prefill_replicas" if p < 1 else "decode_replicas"
        raise ConfigError(owner, field, "must be >= 1: disaggregation needs at least one "
                          "prefill and one decode replica (--prefill-replicas P "
                          "--decode-replicas D)")
    refused = {"data_parallel_size": (cfg.data_parallel_size > 1, "--dp"),
               "nnodes": (cfg.nnodes > 1, "--nnodes"),
               "ray_address": (cfg.ray_address is not None, "Ray placement")}
    for field, (bad, what) in refused.items():
        if bad:
            raise ConfigError(owner, field, f"is not supported with prefill/decode "
                              f"disaggregation yet ({what}); drop one of them")
    if cfg.speculative == "draft":
        raise ConfigError(owner, "speculative", "draft is not supported with prefill/decode "
                          "disaggregation yet (the decode replica would need the draft "
                          "model's KV of each prompt); use ngram, which the decode replicas "
                          "run, or drop one of them")
    if cfg.kv_transfer == "shared" and (why := cross_gpu_obstacle(cfg)):
        raise ConfigError(owner, "kv_transfer", f"shared cannot work here: {why}; use "
                          "frames (--kv-transfer frames)")


def kv_transfer_mode(cfg: EngineConfig) -> str:
    """--kv-transfer resolved: auto is shared where it can work (the CPU; cuda with the
    replicas on one GPU, where it halves the short requests' ITL p99 against colocated on an
    H200, or on GPUs of their own with peer access between them), frames otherwise."""
    if not cfg.prefill_replicas:
        return "frames"
    if cfg.kv_transfer is not None:
        return cfg.kv_transfer
    return "frames" if cross_gpu_obstacle(cfg) else "shared"


def cross_gpu_obstacle(cfg: EngineConfig) -> str | None:
    """Why shared pools cannot work between the replicas' GPUs (None: they can, or there is
    nothing to cross: the CPU, or one GPU shared by every replica)."""
    if cfg.resolved_device != "cuda" or not cfg.prefill_replicas or gpus_shared(cfg):
        return None
    tp = cfg.tensor_parallel_size
    return disagg_gpus.peer_obstacle(
        visible_gpus(),
        disagg_gpus.reading_pairs(tp, cfg.prefill_replicas, cfg.decode_replicas),
        disagg_gpus.can_access_peer)


def replica_links(cfg: EngineConfig, replicas: list[Endpoints]) -> list[dict[str, Any]]:
    """Per replica, what its start specs add: {"scheduler": {...}, "ranks": [{...}, ...]}
    (empty dicts without disaggregation)."""
    roles = cfg.replica_roles
    tp = cfg.tensor_parallel_size
    if not cfg.prefill_replicas:
        return [{"scheduler": {}, "ranks": [{}] * tp} for _ in replicas]
    transfer = [[_transfer_address(ep, i, r) if roles[i] == "decode" else ""
                 for i, ep in enumerate(replicas)] for r in range(tp)]
    out = []
    for i in range(len(replicas)):
        peers = tuple(other.scheduler_in if roles[j] != roles[i] else ""
                      for j, other in enumerate(replicas))
        links = KVLinks(roles[i], i, peers, mode=kv_transfer_mode(cfg))
        out.append({"scheduler": {"kv_links": to_plain(links)},
                    "ranks": [{"kv_links": to_plain(replace(links, transfer=tuple(transfer[r])))}
                              for r in range(tp)]})
    return out


def replicas_down(cfg: EngineConfig, down: dict[int, str]) -> str:
    """/health's reason for the replicas that are down (index -> why). With every prefill
    replica among them it is a NoNewRequests: no new request can be served."""
    why = "; ".join(f"replica {i} is down: {reason}" for i, reason in sorted(down.items()))
    if cfg.prefill_replicas and all(i in down for i in range(cfg.prefill_replicas)):
        return NoNewRequests(f"{why}; no prefill replica is alive: new requests are "
                             f"refused, the decode replicas finish the requests they hold")
    return why


def _transfer_address(ep: Endpoints, replica: int, rank: int) -> str:
    if ep.keys is None:
        return f"ipc://{ep.run_dir}/r{replica}_kv_r{rank}"
    host = ep.scheduler_in.rsplit(":", 1)[0].removeprefix("tcp://")
    return f"tcp://{host}:{_free_ports(1, host)[0]}"


def scheduler_role(cfg: EngineConfig, sched_cfg, replica: int):
    """A replica's SchedulerConfig: its role and index."""
    role = cfg.replica_roles[replica]
    if not role:
        return sched_cfg
    return replace(sched_cfg, role=role, replica=replica,
                   handoff_ranks=cfg.tensor_parallel_size)


def worker_env(cfg: EngineConfig, replica: int) -> dict[str, str] | None:
    """The GPUs replica's workers see: their own group (startup.replica_env), every group
    with their own first when KV moves through shared pools between groups (disagg_gpus), or,
    on cuda with fewer GPUs than prefill + decode groups (one H200), all replicas the same
    ones, each worker taking its share of --gpu-memory-utilization (WorkerConfig.gpu_share)."""
    if cfg.resolved_device != "cuda" or not cfg.prefill_replicas:
        return replica_env(cfg.resolved_device, cfg.tensor_parallel_size, cfg.num_replicas,
                           replica)
    devices, tp = visible_gpus(), cfg.tensor_parallel_size
    if gpus_shared(cfg):
        return {"CUDA_VISIBLE_DEVICES": ",".join(devices[:tp])}
    see_all = kv_transfer_mode(cfg) == "shared"
    return {"CUDA_VISIBLE_DEVICES": ",".join(disagg_gpus.worker_gpus(
        devices, tp, cfg.num_replicas, replica, see_all))}


def gpus_shared(cfg: EngineConfig) -> bool:
    """Whether the replicas share GPUs (too few for one group each)."""
    if cfg.resolved_device != "cuda" or not cfg.prefill_replicas:
        return False
    return len(visible_gpus()) < cfg.tensor_parallel_size * cfg.num_replicas
