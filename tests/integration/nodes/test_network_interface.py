"""cluster.network.interface on real nodes: every node must have it, and the one that does not is named.

Two nodes in network namespaces (each has eth0 and lo); node-a also gets an `ib0` (a veth pair inside its
namespace), so that one check passes on both nodes and another fails on node-b alone. One cluster start.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tasks.launch.cluster import ClusterConfig
from tasks.nodes.check import NodeCheckFailed, raise_for_blocking, run_node_checks
from tasks.nodes.config import NodesConfig
from tests.integration.nodes.conftest import free_port, require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """node-a (eth0, ib0, lo) and node-b (eth0, lo), each in its own network namespace."""
    require("netns")
    cluster = start_cluster(tmp_path_factory.mktemp("interface"), [HostSpec("node-a"), HostSpec("node-b")], "netns")
    try:
        netns = cluster.host("node-a").netns
        assert netns is not None
        subprocess.run(
            ["ip", "-n", netns, "link", "add", "ib0", "type", "veth", "peer", "name", "ib0peer"],
            check=True,
            capture_output=True,
        )
        yield cluster
    finally:
        cluster.close()


def _cluster(interface: str, rdzv_port: int) -> ClusterConfig:
    """Two nodes under the SSH launcher, whose rendezvous port is cluster.rdzv_port."""
    return ClusterConfig(
        scheduler="ssh", nodes=2, procs_per_node=1, rdzv_port=rdzv_port, network={"interface": interface}
    )


def test_an_interface_every_node_has_passes_and_the_port_check_uses_the_jobs_port(two_nodes: SshdCluster) -> None:
    port = free_port()
    report = run_node_checks(NodesConfig(**two_nodes.nodes_section()), _cluster("eth0", port))
    assert report.ok, [(r.check, r.finding) for r in report.blocking]
    assert report.row("network interface eth0").values == {"node-a": "ok", "node-b": "ok"}
    assert report.row(f"rendezvous port {port}").values["node-b"].startswith("connected in")
    raise_for_blocking(report)


def test_an_interface_one_node_lacks_blocks_naming_that_node_and_the_interfaces_it_has(
    two_nodes: SshdCluster,
) -> None:
    report = run_node_checks(NodesConfig(**two_nodes.nodes_section()), _cluster("ib0", free_port()))
    row = report.row("network interface ib0")
    assert row.severity == "blocking" and row.hosts == ["node-b"], (row, report.log[-2000:])
    assert row.values["node-a"] == "ok"
    assert row.values["node-b"] == "missing (has eth0, lo)"
    assert report.blocking_hosts == ["node-b"], [(r.check, r.finding) for r in report.blocking]
    with pytest.raises(NodeCheckFailed) as err:
        raise_for_blocking(report)
    assert "node-b has no interface ib0" in str(err.value)
    assert "set cluster.network.interface to the interface every node has" in str(err.value)
