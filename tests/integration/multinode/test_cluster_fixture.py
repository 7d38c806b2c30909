"""The multi-host test cluster itself: names, shared folder, S3, link faults, and tests.devcluster up/down."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from tests.devcluster import CLUSTER_FILE, NODES_FILE
from tests.integration.multinode.conftest import HOST_NAMES, require_netns
from tests.integration.nodes.testhosts import LinkFaultUnsupported, SshdCluster, SshdHost
from tests.processes import run_group

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]


def run_on(host: SshdHost, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run a command inside the host's namespaces."""
    return subprocess.run(host.enter(list(argv)), capture_output=True, text=True, timeout=60)


def connects(source: SshdHost, target: SshdHost, port: int = 22, timeout_s: float = 1.0) -> bool:
    """Whether `source` opens a TCP connection to `target`'s port (a dropped packet or a lost link: False)."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({target.address!r}, {port}), timeout={timeout_s}).close()\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    return run_on(source, sys.executable, "-c", probe).returncode == 0


def reconnects(source: SshdHost, target: SshdHost, timeout_s: float = 30.0) -> bool:
    """Whether `source` reaches `target` again within `timeout_s` (a restored link needs a moment for ARP)."""
    deadline = time.monotonic() + timeout_s
    while not connects(source, target):
        if time.monotonic() > deadline:
            return False
    return True


def test_every_host_has_its_own_name_and_address_and_resolves_the_others(hosts3: SshdCluster) -> None:
    for host in hosts3.hosts:
        assert run_on(host, "hostname").stdout.strip() == host.name
        assert f"inet {host.address}/24" in run_on(host, "ip", "-4", "addr", "show", "eth0").stdout
        assert run_on(host, "ls", "/sys/class/net").stdout.split() == ["eth0", "lo"], "its own sysfs"
        assert run_on(host, "test", "-d", "/sys/fs/cgroup/pids").returncode == 0, "the cgroup mounts stay"
        for other in hosts3.hosts:
            assert run_on(host, "getent", "hosts", other.name).stdout.split()[0] == other.address


def test_a_file_written_on_one_host_is_read_on_the_others_in_the_shared_folder(hosts3: SshdCluster) -> None:
    first, *others = hosts3.hosts
    path = hosts3.shared / "written-on-node-1"
    assert run_on(first, "sh", "-c", f'echo "$(hostname)" > {path}').returncode == 0
    for host in others:
        assert run_on(host, "findmnt", "-n", "-o", "TARGET", str(hosts3.shared)).stdout.strip() == str(hosts3.shared)
        assert run_on(host, "cat", str(path)).stdout.strip() == first.name


def test_the_s3_endpoint_on_the_bridge_serves_every_host(hosts3: SshdCluster) -> None:
    url = hosts3.start_s3()
    assert url.startswith(f"http://{hosts3.bridge_address}:")
    s3 = boto3.client("s3", endpoint_url=url, aws_access_key_id="k", aws_secret_access_key="s")
    s3.create_bucket(Bucket="shared-bucket")
    s3.put_object(Bucket="shared-bucket", Key="hello.txt", Body=b"from the root namespace")
    signed = s3.generate_presigned_url("get_object", Params={"Bucket": "shared-bucket", "Key": "hello.txt"})
    for host in hosts3.hosts:
        read = run_on(host, "curl", "-sSf", signed)
        assert read.stdout == "from the root namespace", (host.name, read.stderr)


def test_a_cut_link_isolates_a_host_until_it_is_restored(hosts3: SshdCluster) -> None:
    first, second = hosts3.hosts[0], hosts3.hosts[1]
    assert connects(second, first)
    first.cut_link()
    try:
        assert not connects(second, first)
        assert not connects(first, second)
    finally:
        first.restore_link()
    assert reconnects(second, first)


def test_unblock_port_undoes_block_port(hosts3: SshdCluster) -> None:
    first, second = hosts3.hosts[0], hosts3.hosts[1]
    first.block_port(22)
    try:
        assert not connects(second, first)
    finally:
        first.unblock_port(22)
    assert reconnects(second, first)


def test_a_rate_limit_is_set_on_the_link_and_cleared(hosts3: SshdCluster) -> None:
    host = hosts3.hosts[2]
    host.delay_link(rate_mbit=2)
    try:
        assert "tbf" in host.link_qdisc() and "2Mbit" in host.link_qdisc()
        assert connects(hosts3.hosts[0], host), "a slow link still carries traffic"
    finally:
        host.clear_link()
    assert "tbf" not in host.link_qdisc()


def test_a_delay_is_set_with_netem_or_names_the_missing_kernel_module(hosts3: SshdCluster) -> None:
    host = hosts3.hosts[2]
    try:
        host.delay_link(delay_ms=20)
    except LinkFaultUnsupported as err:  # this kernel was built without sch_netem
        assert err.qdisc == "netem" and "sch_netem" in str(err)
        assert "netem" not in host.link_qdisc()
        return
    try:
        assert "netem" in host.link_qdisc() and "delay 20" in host.link_qdisc()
    finally:
        host.clear_link()
    assert "netem" not in host.link_qdisc()


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie (this machine's PID 1 does not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _netns() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines()}


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def test_devcluster_up_leaves_a_usable_cluster_and_down_removes_all_it_started(tmp_path: Path) -> None:
    require_netns()
    workdir = tmp_path / "dev"
    cli = [sys.executable, "-m", "tests.devcluster"]
    started = run_group([*cli, "up", "--hosts", "2", "--dir", str(workdir)], timeout=120, cwd=REPO)
    data = json.loads((workdir / CLUSTER_FILE).read_text()) if (workdir / CLUSTER_FILE).exists() else None
    try:
        assert started.returncode == 0, started.stderr
        assert data is not None and [h["name"] for h in data["hosts"]] == list(HOST_NAMES[:2])
        pids = [h["sshd_pid"] for h in data["hosts"]] + [data["s3_pid"]]
        assert all(_running(pid) for pid in pids), "the daemons outlive `up`"
        assert {h["netns"] for h in data["hosts"]} <= _netns()
        assert "nodes:" in (workdir / NODES_FILE).read_text() and "ssh " in started.stdout
        login = subprocess.run(
            ["ssh", "-i", data["key_path"], "-o", f"UserKnownHostsFile={data['known_hosts_path']}", "-o",
             "BatchMode=yes", f"root@{data['hosts'][1]['address']}", "hostname"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert login.stdout.strip() == "node-2", login.stderr
    finally:
        stopped = run_group([*cli, "down", "--dir", str(workdir)], timeout=120, cwd=REPO)
    assert stopped.returncode == 0, stopped.stderr
    assert not any(_running(pid) for pid in pids)
    assert not {h["netns"] for h in data["hosts"]} & _netns()
    assert not any(_link_exists(name) for name in [data["bridge"], *(h["veth"] for h in data["hosts"])])
    assert not (workdir / CLUSTER_FILE).exists()
