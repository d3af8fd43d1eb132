from __future__ import annotations

import os
import stat

from protocol import Endpoints


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
    internal = [ep.tokenizer, ep.tokenizer_ctl, ep.results, ep.scheduler_in, ep.step_results,
                ep.detok_in, ep.deltas_pub, ep.control, *ep.worker_steps]
    assert all(x.startswith("tcp://127.0.0.1:") for x in internal)
    assert len(set(internal)) == len(internal)
    assert ep.dist_init_method.startswith("tcp://127.0.0.1:")
    public = Endpoints.tcp(1, host="0.0.0.0", port=12345)
    assert public.tokenizer == "tcp://0.0.0.0:12345"
    assert public.results.startswith("tcp://0.0.0.0:")  # clients elsewhere get results too
    assert public.scheduler_in.startswith("tcp://127.0.0.1:")
