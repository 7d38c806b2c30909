"""Real test nodes over real SSH: a consistent pair on loopback, and a faulty cluster in network namespaces."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tasks.launch.cluster import ClusterConfig
from tasks.nodes.check import run_node_checks
from tasks.nodes.config import NodesConfig
from tasks.nodes.report import NodeReport
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, missing_prerequisites, start_cluster
from training.network import listen_port

# A job Python without site-packages: the same interpreter, but torch is not installed there.
PYTHON_WITHOUT_TORCH = f"{sys.executable} -S"
RDZV_PORT = 29517


def require(network: str) -> None:
    """Fail (not skip) when this machine cannot start test nodes: the tests need them."""
    missing = missing_prerequisites(network)
    if missing:
        pytest.fail(f"test nodes need {', '.join(missing)}: run `bash .ci/setup --test` as root")


def free_port() -> int:
    """A TCP port that is free on every address of this machine now (below the ephemeral range)."""
    return listen_port("")


def two_node_cluster(**overrides: object) -> ClusterConfig:
    """A two-node CPU cluster on a scheduler that runs elsewhere (so both hosts must be listed)."""
    return ClusterConfig(**{"scheduler": "slurm", "nodes": 2, "procs_per_node": 1, **overrides})


@pytest.fixture(scope="module")
def consistent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Two identical nodes on 127.0.0.2 and 127.0.0.3."""
    require("loopback")
    cluster = start_cluster(tmp_path_factory.mktemp("consistent"), [HostSpec("node-a"), HostSpec("node-b")])
    try:
        yield cluster
    finally:
        cluster.close()


@dataclass
class FaultyRun:
    """The faulty cluster and the report of its one check."""

    cluster: SshdCluster
    report: NodeReport


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyRun]:
    """Four nodes in network namespaces, checked once.

    node-a: rendezvous host; its firewall drops the rendezvous port for the other nodes.
    node-b: the job's Python has no torch, the scratch mount is missing, password login is on,
            and its /etc/hosts does not know node-c.
    node-c: sshd stopped.  node-d: sshd frozen with SIGSTOP (accepts TCP, never answers).
    """
    require("netns")
    specs = [
        HostSpec("node-a"),
        HostSpec(
            "node-b", python=PYTHON_WITHOUT_TORCH, has_scratch=False, password_auth=True, unresolvable=("node-c",)
        ),
        HostSpec("node-c"),
        HostSpec("node-d"),
    ]
    cluster = start_cluster(tmp_path_factory.mktemp("faulty"), specs, network="netns")
    try:
        cluster.host("node-a").block_port(RDZV_PORT)
        cluster.host("node-c").stop()
        cluster.host("node-d").freeze()
        nodes = NodesConfig(**cluster.nodes_section(rdzv_port=RDZV_PORT))
        report = run_node_checks(nodes, ClusterConfig(scheduler="slurm", nodes=4, procs_per_node=1))
        yield FaultyRun(cluster, report)
    finally:
        cluster.close()
