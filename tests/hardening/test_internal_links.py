"""Attack a running pipeline's internal links as another local user could.

Over tcp every internal port is reachable by anyone on the machine: a stranger without the
run's keys, or with a keypair of its own and the server's public key, must not deliver a
single frame (an abort from a stranger once cancelled the owner's streams). Over ipc the
test itself can reach every socket: garbage and frames of kinds a socket does not accept
must be logged and dropped, and the pipeline must keep serving.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time

import msgpack
import psutil
import pytest
import zmq
from pipeline_config import tiny_engine

from frontend import Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import (
    AbortRequests,
    AddRequest,
    CachedSequences,
    EngineDead,
    FinishReason,
    NewSequence,
    SamplingParams,
    Shutdown,
    StartupFailed,
    StepPlan,
    StepResult,
    encode,
)
from protocol.auth import CurveKeys, load_credentials

pytestmark = pytest.mark.slow  # stalls and kills engine processes

PROMPT = "The quick brown fox"
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ALL_IDS = list(range(2000))  # request ids are a counter from 0: this covers every stream


def _internal(ep) -> dict[str, str]:
    names = ("scheduler_in", "step_results", "detok_in", "control", "tokenizer_ctl")
    links = {name: getattr(ep, name) for name in names}
    links.update({f"worker_steps[{r}]": a for r, a in enumerate(ep.worker_steps)})
    return links


def _damage(name: str) -> list[bytes]:
    """Frames that would hurt if delivered: abort every stream, declare the engine dead,
    stop a worker, or feed a socket a message kind it does not accept."""
    if name == "scheduler_in":
        return [encode(AbortRequests(ALL_IDS, FinishReason.ABORT)), encode(EngineDead("stranger"))]
    if name.startswith("worker_steps"):
        return [encode(StepResult(1, [0], [1], None)), encode(Shutdown("stranger"))]
    if name == "control":
        return [encode(StartupFailed("worker", 0, "stranger"))]
    return [encode(EngineDead("stranger")), b"\xc1garbage"]


def _stream(client: Client, params: SamplingParams) -> tuple[list[int], str | None]:
    ids, finish = [], None
    for delta in client.stream(PROMPT, params=params):
        ids += delta.token_ids
        finish = delta.finish_reason or finish
    return ids, finish


@pytest.fixture(scope="module")
def tcp_pipeline(tiny_qwen3_dir):
    config = EngineConfig(**tiny_engine(tiny_qwen3_dir, transport="tcp",
                                        tensor_parallel_size=2))
    with Pipeline(config) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def reference(tcp_pipeline) -> list[int]:
    with Client(tcp_pipeline.address) as client:
        ids, finish = _stream(client, LONG)
    assert finish == "length" and len(ids) == LONG.max_tokens
    return ids


def _attack_while_streaming(pipeline, attack) -> tuple[list[int], str | None]:
    """Run `attack()` once the owner's stream has produced its first tokens."""
    with Client(pipeline.address) as client:
        ids, finish, attacked = [], None, False
        for delta in client.stream(PROMPT, params=LONG):
            ids += delta.token_ids
            finish = delta.finish_reason or finish
            if ids and not attacked:
                attacked = True
                attack()
        return ids, finish


def _strangers(ctx: zmq.Context, ep) -> list[tuple[str, str, zmq.Socket]]:
    """A PUSH per internal link and identity: no keys, and a self-made keypair that knows
    the server's public key."""
    own_public, own_secret = zmq.curve_keypair()
    socks = []
    for name, address in _internal(ep).items():
        for who in ("no keys", "own keypair"):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            # Queue frames only on a finished handshake, so a send that succeeds means
            # the link accepted this peer (by default a connecting PUSH queues at once).
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if who == "own keypair":
                sock.setsockopt(zmq.CURVE_SERVERKEY, ep.keys.server_public)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, own_public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, own_secret)
            sock.connect(address)
            socks.append((name, who, sock))
    return socks


def _listeners(pipeline) -> list[tuple[int, str, int]]:
    pids = {child.pid for child in pipeline.children} | {os.getpid()}
    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def test_nothing_listens_beyond_loopback_with_tcp_and_tp2(tcp_pipeline):
    # First in the file: the attacks below must not have stopped any process yet.
    listeners = _listeners(tcp_pipeline)
    assert listeners, "the tcp pipeline should listen on loopback ports"
    beyond = [entry for entry in listeners if not ipaddress.ip_address(entry[1]).is_loopback]
    assert beyond == []  # in particular no 0.0.0.0 or :: (torch's TCPStore did)
    public = {tcp_pipeline.endpoints.tokenizer, tcp_pipeline.endpoints.results}
    assert all(a.startswith("tcp://127.0.0.1:") for a in public)


def test_strangers_cannot_deliver_a_frame_on_any_internal_tcp_link(tcp_pipeline, reference):
    ep = tcp_pipeline.endpoints
    ctx = zmq.Context()
    delivered: list[str] = []

    def attack() -> None:
        socks = _strangers(ctx, ep)
        deadline = time.monotonic() + 0.5  # time enough for any handshake to finish
        while time.monotonic() < deadline:
            for name, who, sock in socks:
                for frame in _damage(name):
                    try:
                        sock.send(frame, zmq.NOBLOCK)
                        delivered.append(f"{name} ({who})")
                    except zmq.Again:
                        pass  # no authenticated peer: the frame cannot even be queued
            time.sleep(0.02)
        for _, _, sock in socks:
            sock.close()

    try:
        ids, finish = _attack_while_streaming(tcp_pipeline, attack)
    finally:
        ctx.term()
    assert delivered == []
    assert (ids, finish) == (reference, "length")  # not aborted, not disturbed
    with Client(tcp_pipeline.address) as client:  # and the pipeline goes on serving
        assert _stream(client, LONG) == (reference, "length")
    assert tcp_pipeline.alive


def test_strangers_cannot_read_the_deltas_but_a_tool_with_the_credentials_can(tcp_pipeline):
    ep = tcp_pipeline.endpoints
    creds = load_credentials(ep.run_dir)
    ctx = zmq.Context()
    subs = {}
    own = CurveKeys.generate()
    for who, keys in (("no keys", None), ("credentials", creds.keys),
                      ("own keypair", CurveKeys(ep.keys.server_public, own.client_public,
                                                own.client_secret))):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if keys is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        sock.connect(creds.deltas_pub)
        subs[who] = sock
    try:
        time.sleep(0.5)  # subscriptions reach the PUB before the request starts
        with Client(tcp_pipeline.address) as client:
            _stream(client, SHORT)
        got = {who: sock.poll(1000) for who, sock in subs.items()}
    finally:
        for sock in subs.values():
            sock.close()
        ctx.term()
    assert got == {"no keys": False, "credentials": True, "own keypair": False}


def test_a_member_of_the_run_can_abort_so_the_attack_above_is_real(tcp_pipeline, reference):
    """The same abort sent with the run's keys cancels the stream: refusing strangers is
    what saved it."""
    ep = tcp_pipeline.endpoints
    ctx = zmq.Context()

    def attack() -> None:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.CURVE_SERVERKEY, ep.keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, ep.keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, ep.keys.client_secret)
        sock.connect(ep.scheduler_in)
        sock.send(encode(AbortRequests(ALL_IDS, FinishReason.ABORT)))
        sock.close()

    try:
        ids, finish = _attack_while_streaming(tcp_pipeline, attack)
    finally:
        ctx.term()
    assert finish == "abort" and len(ids) < len(reference)


# ---------------------------------------------------------------- ipc: garbage is dropped


@pytest.fixture(scope="module")
def ipc_pipeline(tiny_qwen3_dir):
    with Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir))) as pipeline:
        yield pipeline


def _bad_token_bins() -> list[bytes]:
    """An AddRequest and a StepPlan whose packed int32 token ids are not whole int32s, and an
    AddRequest whose ids come as a list (the old form) with one past int32."""
    request = msgpack.unpackb(encode(AddRequest(7, [1, 2], SamplingParams(), [0])))
    torn, listed = list(request), list(request)
    torn[2], listed[2] = torn[2][:-1], [1, 2**40]
    plan = msgpack.unpackb(encode(StepPlan(
        0, [], [NewSequence(7, [1, 2], 2, 0, 2, [0], SamplingParams())],
        CachedSequences([], [], []))))
    plan[3][0][1] = plan[3][0][1] + b"\x01"
    return [msgpack.packb(m, use_bin_type=True) for m in (torn, listed, plan)]


def _garbage(name: str) -> list[bytes]:
    wrong_kind = encode(AddRequest(0, [1], SamplingParams(), [0]))
    if name == "scheduler_in":
        wrong_kind = encode(StepResult(1, [0], [1], None))
    return [b"", b"\x00" * 7, b"\xc1", b"not msgpack at all", msgpack.packb({"kind": 1}),
            msgpack.packb([0x7F, 1, 2]), msgpack.packb([0x21, "x"]), wrong_kind,
            *_bad_token_bins(), os.urandom(512)]


def test_garbage_and_unexpected_kinds_on_every_internal_socket_are_dropped(ipc_pipeline):
    with Client(ipc_pipeline.address) as client:
        before = _stream(client, SHORT)
    ctx = zmq.Context()
    try:
        for name, address in _internal(ipc_pipeline.endpoints).items():
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            for frame in _garbage(name):
                sock.send(frame)
            sock.send_multipart([b"\xc1", b"\xc1"])
            sock.close()  # linger: every frame is handed over before we go on
    finally:
        ctx.term()
    time.sleep(1.0)  # let each actor read and drop them
    assert ipc_pipeline.alive, ipc_pipeline.dead_reason
    with Client(ipc_pipeline.address) as client:
        assert _stream(client, SHORT) == before
    assert ipc_pipeline.alive


def test_the_launcher_drops_a_bad_control_frame_during_start_up(tmp_path):
    """A garbage frame on the control socket used to end start-up with a ProtocolError."""
    from protocol import Ready
    from protocol.sockets import MessageSocket

    pipeline = Pipeline(EngineConfig(model=None))
    pipeline._ctx = zmq.Context()
    address = f"ipc://{tmp_path}/control"
    pipeline._control = MessageSocket(pipeline._ctx, zmq.PULL, address, bind=True,
                                      accepts=(Ready, StartupFailed))
    pipeline._replica_controls = [pipeline._control]  # one replica: its control socket
    push = pipeline._ctx.socket(zmq.PUSH)
    push.connect(address)
    ready = Ready("worker", 0, 5, "")
    try:
        push.send(b"\xc1garbage")
        push.send(encode(EngineDead("not a control message")))
        push.send(encode(ready))
        result: list = []
        t = threading.Thread(target=lambda: result.append(
            pipeline._await_ready({("worker", 0)}, time.monotonic() + 10)))
        t.start()
        t.join(15)
        assert result == [[ready]]
    finally:
        push.close(0)
        pipeline._control.close()
        pipeline._ctx.term()
