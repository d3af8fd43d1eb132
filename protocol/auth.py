"""Peer authentication of a pipeline's internal links over TCP (ZeroMQ CURVE).

A run makes two CURVE keypairs: every socket that binds an internal link is a CURVE server
with the server secret, every socket that connects to one is a CURVE client with the
client keypair. Knowing the server's public key is not enough to get in: each context that
binds a CURVE server runs a ZAP handler whose allow-list holds only the run's client public
key, and the server sockets enforce their ZAP domain, so with no handler a peer is refused
rather than waved through. The public client sockets (the tokenizer and results ROUTERs)
use no CURVE and accept anyone.

Over ipc:// the links are not encrypted: the sockets live in a 0700 run directory that no
other user can enter, which is the same guard the rest of the run's files have (measured
cost of CURVE on one StepPlan hop: see `Endpoints.ipc`).

A local tool that attaches to a tcp pipeline (a stdout detokenizer on `deltas_pub`) reads
the client side of the keys from the run directory with `load_credentials`.

A pipeline spread over several hosts (`--nnodes`) cannot hand per-run keys to the other
hosts' processes, so its keys are derived from a secret in a cluster key file that node 0
creates and the user copies to every other host (see `read_cluster_key`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass

import zmq
from zmq.utils import z85

log = logging.getLogger("nanopipe.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler about each new peer (RFC 27)."""
ZAP_DOMAIN = b"nanopipe-internal"
CREDENTIALS_FILE = "credentials"
"""Name of the 0600 file in a tcp pipeline's run directory that authorised tools read."""


@dataclass(frozen=True)
class CurveKeys:
    """One run's CURVE keys, Z85-encoded (40 bytes each).

    `server_secret` is None in the copy handed to a tool that only connects: it can reach
    the internal links as a client but cannot pose as any of them."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public=server_public, client_public=client_public,
                   client_secret=client_secret, server_secret=server_secret)

    def client_only(self) -> CurveKeys:
        return CurveKeys(self.server_public, self.client_public, self.client_secret)

    def __repr__(self) -> str:  # keep secrets out of logs and tracebacks
        return f"CurveKeys(server_public={self.server_public!r}, ...)"


def secure(sock: zmq.Socket, keys: CurveKeys | None, *, server: bool) -> None:
    """Make `sock` (not yet bound or connected) a CURVE server or client of the run.

    Does nothing when keys is None (ipc links and the public sockets)."""
    if keys is None:
        return
    if server:
        if keys.server_secret is None:
            raise ValueError("binding an internal link needs the run's server secret key")
        ensure_zap_handler(sock.context, keys.client_public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        # Refuse every peer when no ZAP handler answers, instead of accepting any key.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


# ---------------------------------------------------------------- ZAP


def ensure_zap_handler(ctx: zmq.Context, allowed_client_key: bytes) -> None:
    """Start the ZAP handler of `ctx` unless one runs already (one run's keys per context).

    The handler lives as long as the context: `ctx.term()` ends it, so no caller has to
    stop it first."""
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    try:
        rep.bind(ZAP_ENDPOINT)
    except zmq.ZMQError as exc:
        rep.close()
        if exc.errno == zmq.EADDRINUSE:
            return  # the inproc name is per context: this context has its handler
        raise
    threading.Thread(target=_serve_zap, args=(rep, z85.decode(allowed_client_key)),
                     name="nanopipe-zap", daemon=True).start()


def _serve_zap(rep: zmq.Socket, allowed: bytes) -> None:
    try:
        while True:
            try:
                request = rep.recv_multipart()
            except zmq.ContextTerminated:
                return
            rep.send_multipart(zap_reply(request, allowed))
    except zmq.ZMQError as exc:  # never raised in practice; a dead handler refuses all
        log.error("ZAP handler stopped: %s", exc)
    finally:
        rep.close()


def zap_reply(request: list[bytes], allowed: bytes) -> list[bytes]:
    """The ZAP (RFC 27) answer to one request: CURVE peers of our domain pass only with the
    allowed client key; NULL peers (public sockets that ask) pass; everything else fails."""
    if len(request) < 6 or request[0] != b"1.0":
        request_id = request[1] if len(request) > 1 else b""
        return [b"1.0", request_id, b"400", b"malformed ZAP request", b"", b""]
    _, request_id, domain, address, _, mechanism, *credentials = request
    if mechanism == b"NULL" and domain != ZAP_DOMAIN:
        return [b"1.0", request_id, b"200", b"OK", b"", b""]
    if (mechanism == b"CURVE" and domain == ZAP_DOMAIN and credentials
            and credentials[0] == allowed):
        return [b"1.0", request_id, b"200", b"OK", b"internal", b""]
    log.warning("refused a %s peer from %s on an internal link",
                mechanism.decode(errors="replace"), address.decode(errors="replace"))
    return [b"1.0", request_id, b"400", b"not a member of this run", b"", b""]


# ---------------------------------------------------------------- credentials file


@dataclass(frozen=True)
class Credentials:
    """What an authorised local tool needs to subscribe to a tcp pipeline's deltas."""

    deltas_pub: str
    keys: CurveKeys
    """Client side only (no server secret)."""


def write_credentials(run_dir: str, deltas_pub: str, keys: CurveKeys) -> str:
    """Write the client side of the keys to `run_dir/credentials`, mode 0600."""
    path = os.path.join(run_dir, CREDENTIALS_FILE)
    doc = dict(deltas_pub=deltas_pub, server_public=keys.server_public.decode(),
               client_public=keys.client_public.decode(),
               client_secret=keys.client_secret.decode())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    return path


def load_credentials(path: str) -> Credentials:
    """Read a tcp pipeline's credentials: `path` is its run directory or the file in it.

    Pass `creds.keys` as the `security` of the socket that connects to `creds.deltas_pub`
    (e.g. `ProcessRuntime.socket(zmq.SUB, creds.deltas_pub, bind=False, ...,
    security=creds.keys)`)."""
    if os.path.isdir(path):
        path = os.path.join(path, CREDENTIALS_FILE)
    try:
        with open(path) as f:
            doc = json.load(f)
        keys = CurveKeys(server_public=_key(doc, "server_public"),
                         client_public=_key(doc, "client_public"),
                         client_secret=_key(doc, "client_secret"))
        deltas_pub = doc["deltas_pub"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a nanopipe credentials file ({exc})") from None
    if not isinstance(deltas_pub, str):
        raise ValueError(f"{path}: deltas_pub must be a string")
    return Credentials(deltas_pub=deltas_pub, keys=keys)


def _key(doc: dict, name: str) -> bytes:
    value = doc[name]
    if not isinstance(value, str) or len(value) != 40:
        raise ValueError(f"{name} must be a 40-character Z85 key")
    return value.encode()


# ---------------------------------------------------------------- cluster key file

CLUSTER_SECRET_BYTES = 32


def keys_from_secret(secret: bytes) -> CurveKeys:
    """The CURVE keys of a pipeline spread over several hosts, derived from their shared
    secret, so every host computes the same keys with nothing sent over the network."""
    if len(secret) < CLUSTER_SECRET_BYTES:
        raise ValueError(f"a cluster secret needs at least {CLUSTER_SECRET_BYTES} bytes")

    def keypair(label: bytes) -> tuple[bytes, bytes]:
        secret_key = z85.encode(hashlib.sha256(b"nanopipe " + label + b"\0" + secret).digest())
        return zmq.curve_public(secret_key), secret_key

    server_public, server_secret = keypair(b"server")
    client_public, client_secret = keypair(b"client")
    return CurveKeys(server_public=server_public, client_public=client_public,
                     client_secret=client_secret, server_secret=server_secret)


def create_cluster_key(path: str) -> bool:
    """Write a fresh random secret to `path` (mode 0600) unless the file exists; True when
    written. The user copies that file to the other hosts."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(CLUSTER_SECRET_BYTES) + "\n")
    return True


def read_cluster_key(path: str) -> CurveKeys:
    """The keys of the secret in `path`; refuses a file that others may read, as ssh does."""
    try:
        st = os.stat(path)
        if st.st_mode & 0o077:
            raise ValueError(f"{path} is readable by other users: chmod 600 {path}")
        with open(path) as f:
            secret = bytes.fromhex(f.read().strip())
    except OSError as exc:
        raise ValueError(f"cannot read the cluster key {path}: {exc.strerror}") from None
    except ValueError as exc:
        if "chmod" in str(exc):
            raise
        raise ValueError(f"{path} is not a nanopipe cluster key (hex secret)") from None
    return keys_from_secret(secret)
