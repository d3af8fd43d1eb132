"""One tensor-parallel group over two "hosts", started by hand as on two machines: two
`scripts/launch.sh --tp 2 --nnodes 2` invocations over loopback, one rank each. The greedy
tokens through a Client equal one host's; nothing listens beyond the master address; node 1
leaves when node 0 stops; a node that never joins fails with a clear error in time."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from pipeline_config import tiny_engine
from process_watch import alive, descendants

from frontend import LLM, Client
from frontend.engine.cli import parse_serve_args
from frontend.engine.preflight import ephemeral_ports
from protocol import SamplingParams
from protocol.auth import keys_from_secret, read_cluster_key

pytestmark = pytest.mark.slow  # multi-node rendezvous

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = [[5, 6, 7, 8], [300, 2, 71, 9, 44, 12, 3], [17] * 20]


def _ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections (Linux's default without /proc)."""
    return ephemeral_ports() or range(32768, 61000)


def _free_port_range(count: int, ephemeral: bool = False) -> int:
    """A first port P with P .. P+count-1 all free on loopback now, below the ephemeral range
    (or inside it, when asked): the ranks' rendezvous opens outgoing connections before the
    scheduler binds its ports, and one of them may take a free port from that range first."""
    ports = _ephemeral_ports()
    if ephemeral:
        low, high = ports.start, ports.stop
    else:
        low, high = 10000, max(ports.start, 20000 + 2 * count)
    for _ in range(200):
        first = random.randint(low, high - count)
        socks = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port range")


def _launch(model: str, node_rank: int, port: int, key: Path, *extra: str) -> subprocess.Popen:
    cmd = [str(ROOT / "scripts/launch.sh"), model, "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "128", "--max-num-batched-tokens", "256",
           "--tp", "2", "--nnodes", "2", "--node-rank", str(node_rank),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--cluster-key", str(key),
           "--log-stats-interval", "0", *extra]
    if node_rank == 0 and "--port" not in extra:
        cmd.append("--no-http")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _listening(pids: set[int]) -> list[str]:
    """Local addresses that `pids` listen on (from /proc/net/tcp: IPv4 hex)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(fields[1].split(":")[0])
    return found


@pytest.mark.slow
def test_two_nodes_form_one_tp2_group_with_one_hosts_tokens(tiny_qwen3_dir, tmp_path):
    port = _free_port_range(5)
    key = tmp_path / "cluster.key"
    node0 = _launch(tiny_qwen3_dir, 0, port, key)
    node1 = None
    try:
        deadline = time.monotonic() + 30
        while not key.exists():  # node 0 creates the key; the user copies it over
            assert time.monotonic() < deadline and node0.poll() is None
            time.sleep(0.05)
        assert key.stat().st_mode & 0o777 == 0o600
        node1 = _launch(tiny_qwen3_dir, 1, port, key)
        out = ""
        while "clients connect to:" not in out:
            line = node0.stdout.readline()
            assert line, f"node 0 exited: {node0.wait()} {node0.stderr.read()}"
            out += line
        address = re.search(r"clients connect to: (\S+)", out).group(1)
        assert "tp=2" in out

        with Client(address) as client:
            got = [client.generate(prompt_token_ids=p, params=GREEDY).token_ids
                   for p in PROMPTS]
        pids = descendants(node0.pid) | descendants(node1.pid) | {node0.pid, node1.pid}
        # IPv4 loopback 127.0.0.1 is 0100007F in /proc/net/tcp; nothing on any other address.
        assert set(_listening(pids)) == {"0100007F"}

        os.killpg(node0.pid, signal.SIGTERM)
        assert node0.wait(30) == 0
        assert node1.wait(30) == 0, node1.stderr.read()
        assert "node 0 at 127.0.0.1" in node1.stderr.read()
        assert not [pid for pid in pids if alive(pid)]
    finally:
        _stop(node0, *([node1] if node1 else []))

    with LLM(**tiny_engine(tiny_qwen3_dir, max_model_len=128)) as llm:
        one = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert got == [r["token_ids"] for r in one]


@pytest.mark.parametrize("node_rank,message", [
    (0, "not every rank joined the rendezvous at 127.0.0.1"),
    (1, "could not reach node 0's rendezvous at 127.0.0.1"),
])
def test_a_node_alone_fails_clearly_within_the_timeout(tiny_qwen3_dir, tmp_path, node_rank,
                                                       message):
    port = _free_port_range(5)
    key = tmp_path / "cluster.key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    start = time.monotonic()
    node = _launch(tiny_qwen3_dir, node_rank, port, key, "--startup-timeout-s", "6")
    try:
        _, err = node.communicate(timeout=90)
    finally:
        _stop(node)
    assert node.returncode == 1
    assert message in err, err
    assert "Traceback" not in err  # an expected failure, told in its own words
    assert time.monotonic() - start < 60


def test_node_0_warns_when_its_master_ports_are_ephemeral(tiny_qwen3_dir, tmp_path):
    """A --master-port whose ports outgoing connections may take first is named at start-up,
    with a port that avoids it."""
    port = _free_port_range(5, ephemeral=True)
    key = tmp_path / "cluster.key"
    node = _launch(tiny_qwen3_dir, 0, port, key, "--startup-timeout-s", "4")
    try:
        _, err = node.communicate(timeout=90)
    finally:
        _stop(node)
    assert f"the --master-port ports {port}-{port + 4} overlap the kernel's ephemeral" in err
    below = int(re.search(r"a port below (\d+)", err).group(1))
    assert below + 5 <= _ephemeral_ports().start


def test_multi_node_flags_name_what_is_missing(tmp_path, capsys):
    def usage_error(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            parse_serve_args(list(argv))
        assert exit_.value.code == 2
        return capsys.readouterr().err

    assert "--master-addr is required with nnodes 2" in usage_error("--nnodes", "2")
    assert "--node-rank must be < nnodes (2)" in usage_error(
        "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "5",
        "--cluster-key", "k")
    assert "--tp must be a multiple of nnodes (2)" in usage_error(
        "--nnodes", "2", "--master-addr", "h", "--master-port", "5", "--cluster-key", "k")
    assert "--master-port applies only with nnodes > 1" in usage_error("--master-port", "5")
    assert "--port applies to node 0" in usage_error(
        "--nnodes", "2", "--tp", "2", "--node-rank", "1", "--master-addr", "h",
        "--master-port", "5", "--cluster-key", "k", "--port", "8000")


def test_cluster_key_file_is_private_and_gives_every_host_the_same_keys(tmp_path):
    key = tmp_path / "k"
    key.write_text("0f" * 32)
    key.chmod(0o640)
    with pytest.raises(ValueError, match="readable by other users: chmod 600"):
        read_cluster_key(str(key))
    key.chmod(0o600)
    assert read_cluster_key(str(key)) == keys_from_secret(bytes.fromhex("0f" * 32))
    with pytest.raises(ValueError, match="cannot read the cluster key"):
        read_cluster_key(str(tmp_path / "missing"))
    key.write_text("not hex")
    with pytest.raises(ValueError, match="not a nanopipe cluster key"):
        read_cluster_key(str(key))
