"""Checks made before any process starts, each failing with one line that says what to change.

A wrong model path, a GPU that is not there, a tensor-parallel size the model cannot be
split into or a port that is taken would otherwise surface as a traceback from a child
process after seconds of loading, or not at all.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
from pathlib import Path

from frontend.actors.model_tokenizer import check_tokenizer_files
from frontend.engine.config import EngineConfig
from frontend.engine.options import ConfigError
from protocol import model_config as hf
from protocol.checkpoint_match import check_checkpoint_matches
from protocol.model_shape import ModelShape

log = logging.getLogger(__name__)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def check_model_path(model: str) -> None:
    """A local model directory with a config.json: nanopipe loads nothing from a hub."""
    if not os.path.exists(model):
        hint = (" (it looks like a hub id: nanopipe loads no weights from a hub; download the"
                " model and pass its directory)" if _looks_like_hub_id(model) else "")
        raise ValueError(f"model {model!r} does not exist{hint}")
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is not a directory (pass the directory that holds "
                         "config.json and the safetensors files)")
    if not hf.has_model_config(model):
        raise ValueError(f"model directory {model!r} has no {hf.CONFIG_FILE}")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def check_device(config: EngineConfig) -> None:
    if config.device != "cuda":
        return
    from frontend.engine.torch_build import built_for_gpus, gpu_count

    count = gpu_count()  # without torch where the driver says (torch_build)
    if count == 0:
        built = "no visible GPU" if built_for_gpus() else "a CPU-only build of torch"
        raise ValueError(f"device 'cuda' was asked for but CUDA is not available ({built}); "
                         "use --device cpu")
    if config.tensor_parallel_size > count:
        raise ValueError(f"tensor parallel size {config.tensor_parallel_size} needs "
                         f"{config.tensor_parallel_size} GPUs but {count} are visible")
    needed = config.tensor_parallel_size * config.data_parallel_size
    if needed > count:
        raise ValueError(f"{config.data_parallel_size} data-parallel replicas of tensor "
                         f"parallel size {config.tensor_parallel_size} need {needed} GPUs "
                         f"but {count} are visible")


def check_model_fits_tp(config: EngineConfig) -> None:
    """The model's type and dtype are supported and its heads can be split `tp` ways.

    With the workers' own parser (protocol.model_shape), which needs no torch: importing
    gpu_workers here would cost the launcher torch's seconds of start-up.
    """
    try:
        model = ModelShape.from_dir(config.model_dir, config.dtype)
    except hf.ModelConfigError as exc:
        raise ValueError(f"model {config.model_dir!r}: {exc}") from None
    model.head_shards(config.tensor_parallel_size)


def check_model_files(config: EngineConfig) -> None:
    """The checkpoint is sound and is the model config.json describes (from the safetensors
    headers, reading no tensor), and the tokenizer loads: a mismatch would otherwise load
    silently and serve wrong tokens, or fail in a child process with a traceback."""
    model_dir = config.model_dir
    try:
        check_checkpoint_matches(model_dir, ModelShape.from_dir(model_dir, config.dtype))
    except ValueError as exc:
        raise ValueError(f"model {model_dir!r}: {exc}") from None
    check_tokenizer_files(model_dir)


def check_draft_model(config: EngineConfig) -> None:
    """The draft model passes the target's checks: a supported shape that splits `tp` ways,
    and a checkpoint its config.json describes (its tokenizer is the target's)."""
    draft = config.resolved_draft_model  # a directory whose vocabulary is the target's
    if draft is None:
        return
    try:
        shape = ModelShape.from_dir(draft, config.dtype)
        shape.head_shards(config.tensor_parallel_size)
        check_checkpoint_matches(draft, shape)
    except ValueError as exc:
        raise ConfigError("EngineConfig", "draft_model", f"{draft!r}: {exc}") from None


def check_port_free(host: str, port: int, what: str) -> None:
    """Refuse a port that something already listens on (checked by binding it briefly)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(port_unavailable(host, port, what, exc)) from None


def port_unavailable(host: str, port: int, what: str, exc: OSError) -> str:
    """The one line that says why `what` cannot listen on host:port."""
    if exc.errno == errno.EADDRINUSE:
        return f"{what} port {port} on {host} is already in use"
    return f"cannot listen on {host}:{port} for {what}: {exc.strerror or exc}"


def ephemeral_ports() -> range | None:
    """The local ports the kernel hands to outgoing connections (Linux); None where unknown."""
    try:
        low, high = map(int, Path(EPHEMERAL_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def warn_if_master_ports_ephemeral(ports: range) -> None:
    """Warn when node 0's cluster ports lie in the ephemeral range: the ranks' rendezvous
    opens outgoing connections before the scheduler binds those ports, and one of those
    connections may take such a port first ("Address already in use" at start-up)."""
    ephemeral = ephemeral_ports()
    if ephemeral is None or ports.stop <= ephemeral.start or ports.start >= ephemeral.stop:
        return
    log.warning("the --master-port ports %d-%d overlap the kernel's ephemeral ports %d-%d, "
                "which outgoing connections may take first; a port below %d (torch's usual "
                "29500) avoids it", ports.start, ports.stop - 1, ephemeral.start,
                ephemeral.stop - 1, ephemeral.start - len(ports))


def warn_if_exposed(what: str, host: str, unless: str) -> None:
    """Warn that `what` listens on `host` beyond loopback with no credentials (`unless` says
    which would guard it): anyone who can reach the host can then use the model."""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass  # a host name: it may resolve to any interface
    log.warning("%s listens on %s without %s: anyone who can reach this host can use it",
                what, host, unless)


def check_default_model(config: EngineConfig) -> None:
    """The embedded model is converted (on first use) here, so that a missing package is a
    one-line error saying what to install."""
    from frontend.embedded_model import DefaultModelError

    try:
        config.model_dir  # noqa: B018 - finds or converts the default model
    except DefaultModelError as exc:
        raise ValueError(str(exc)) from None


class ModelFilesCheck:
    """check_model_files on a thread, so that parsing the tokenizer and the checkpoint's
    headers (a large vocabulary takes a good part of a second) overlaps the workers' start
    instead of preceding it. The launcher asks for the result right after spawning them,
    long before a worker could load anything, and stops them if it is an error."""

    def __init__(self, config: EngineConfig) -> None:
        self._error: ValueError | None = None
        # Not a daemon: when another check fails first the interpreter waits for this one
        # at exit, instead of killing it inside the tokenizers' native code (an abort).
        self._thread = threading.Thread(target=self._run, args=(config,),
                                        name="nanopipe-model-files-check")
        self._thread.start()

    def _run(self, config: EngineConfig) -> None:
        try:
            check_model_files(config)
        except ValueError as exc:
            self._error = exc

    def result(self, error: type[Exception] = ValueError) -> None:
        """Wait for the check; raises its one line as `error`."""
        self._thread.join()
        if self._error is not None:
            raise error(str(self._error)) from None


def check_config(config: EngineConfig, files_beside: bool = False) -> ModelFilesCheck | None:
    """Every check that needs no child process; raises ValueError with one line. With
    `files_beside`, the model files' check runs on a thread and is returned (its result()
    raises); otherwise it runs here."""
    if config.model is not None:
        check_model_path(config.model)
    else:
        check_default_model(config)
    check_device(config)
    check_model_fits_tp(config)
    files = ModelFilesCheck(config) if files_beside else None
    if files is None:
        check_model_files(config)
    config.resolved_max_model_len  # noqa: B018 - raises if above the model's limit
    if config.transport == "tcp":
        warn_if_exposed("the ZMQ client port", config.host, "authentication (it has none: "
                        "keep it on loopback, or serve the HTTP API with --api-key)")
    if (config.transport == "tcp" or config.nnodes > 1) and config.port is not None:
        check_port_free(config.host, config.port, "the client")
    check_draft_model(config)
    if config.nnodes > 1 and config.node_rank == 0:
        from protocol import Endpoints

        ports = Endpoints.cluster_ports(config.tensor_parallel_size, config.master_port)
        for port in ports:
            check_port_free(config.master_addr, port, "a --master-port")
        warn_if_master_ports_ephemeral(ports)
    return files
