"""Control messages: start-up handshake and shutdown."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.codec import message
from protocol.startup_phases import StartupPhase


@message(0x30)
@dataclass(frozen=True, slots=True)
class Ready:
    """Sent once by every process when it is ready to serve.

    It carries what the process learned at start-up (a worker: how many KV blocks fit),
    so nobody mutates a shared config.
    """

    role: str
    rank: int
    num_kv_blocks: int
    info: str
    num_host_slots: int = 0
    """A worker: blocks its host KV tier holds (0: no tier)."""
    host_block_bytes: int = 0
    """A worker: bytes one block of its host tier takes (its shard of every layer's K and V)."""
    phases: list[StartupPhase] = field(default_factory=list)
    """How long its named start-up phases took (loading weights, sizing the KV cache...)."""


@message(0x31)
@dataclass(frozen=True, slots=True)
class Shutdown:
    reason: str


@message(0x32)
@dataclass(frozen=True, slots=True)
class StartupFailed:
    """A process could not start; the launcher reports the message and stops everything."""

    role: str
    rank: int
    error: str


@message(0x33)
@dataclass(frozen=True, slots=True)
class StartupProgress:
    """What a process is doing during a long start-up (loading, profiling, capturing), so
    the person who started the pipeline is not left with seconds of silence."""

    role: str
    rank: int
    text: str


@message(0x34)
@dataclass(frozen=True, slots=True)
class ReplicaDown:
    """Launcher -> tokenizer: one data-parallel replica lost a process. The router stops
    placing requests there and fails the ones it placed there; the other replicas serve on."""

    replica: int
    reason: str
