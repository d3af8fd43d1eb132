from __future__ import annotations

import dataclasses
import os
import stat

import msgpack

from protocol import Endpoints
from protocol.auth import CurveKeys, load_credentials


def test_ipc_endpoints_live_in_a_private_directory_removed_at_cleanup():
    a, b = Endpoints.ipc(2), Endpoints.ipc(2)
    try:
        assert a.run_dir != b.run_dir  # two pipelines never share a socket
        assert stat.S_IMODE(os.stat(a.run_dir).st_mode) == 0o700
        addresses = [a.tokenizer, a.results, a.scheduler_in, *a.worker_steps]
        assert all(x.startswith(f"ipc://{a.run_dir}/") for x in addresses)
        assert len(set(addresses)) == len(addresses)
    finally:
        a.cleanup()
        b.cleanup()
    assert not os.path.exists(a.run_dir) and not os.path.exists(b.run_dir)


def test_tcp_endpoints_bind_loopback_unless_told_otherwise():
    ep = Endpoints.tcp(2)
    public = Endpoints.tcp(1, host="0.0.0.0", port=12345)
    try:
        internal = [ep.tokenizer, ep.tokenizer_ctl, ep.results, ep.scheduler_in,
                    ep.step_results, ep.detok_in, ep.deltas_pub, ep.control, *ep.worker_steps]
        assert all(x.startswith("tcp://127.0.0.1:") for x in internal)
        assert len(set(internal)) == len(internal)
        assert public.tokenizer == "tcp://0.0.0.0:12345"
        assert public.results.startswith("tcp://0.0.0.0:")  # clients elsewhere get results too
        assert public.scheduler_in.startswith("tcp://127.0.0.1:")
    finally:
        ep.cleanup()
        public.cleanup()


def test_tcp_endpoints_keep_a_private_run_directory_with_keys_and_a_file_rendezvous():
    a, b = Endpoints.tcp(2), Endpoints.tcp(2)
    try:
        assert stat.S_IMODE(os.stat(a.run_dir).st_mode) == 0o700
        # The rendezvous is a file there: a TCPStore would listen on every interface.
        assert a.dist_init_method == f"file://{a.run_dir}/dist_init"
        assert a.keys is not None and a.keys.server_secret is not None
        assert a.keys != b.keys  # keys are made per run
        path = os.path.join(a.run_dir, "credentials")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        creds = load_credentials(a.run_dir)
        assert creds.deltas_pub == a.deltas_pub
        assert creds.keys == a.keys.client_only()  # never the server secret
        assert a.keys.server_secret.decode() not in open(path).read()
    finally:
        a.cleanup()
        b.cleanup()
    assert not os.path.exists(a.run_dir)


def _plain(value) -> object:
    """The value as msgpack-able plain data, failing on anything that is not."""
    if dataclasses.is_dataclass(value):
        assert type(value).__dataclass_params__.frozen, type(value)
        return [_plain(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    assert value is None or type(value) in (str, int, bool, bytes), type(value)
    return value


def test_endpoints_are_plain_frozen_data_that_msgpack_carries():
    for ep in (Endpoints.ipc(2), Endpoints.tcp(2)):
        try:
            wire = msgpack.unpackb(msgpack.packb(_plain(ep), use_bin_type=True), raw=False)
            names = [f.name for f in dataclasses.fields(Endpoints)]
            values = dict(zip(names, wire, strict=True))
            keys = values.pop("keys")
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
            keys = CurveKeys(*keys) if keys is not None else None
            assert Endpoints(**values, keys=keys) == ep
        finally:
            ep.cleanup()
