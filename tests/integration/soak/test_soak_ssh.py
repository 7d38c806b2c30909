"""The soak through the SSH launcher: two hosts in network namespaces (own names and addresses, real SSH, one rank
on each) sharing this machine's files and process table. Rank kills, hangs, slow nodes and node losses strike at
random (seeded) every 40 s on average; every one must be recovered by its expected rung. The storage outage
is left out here: the namespace hosts cannot reach the soak's S3 endpoint on this machine's 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.soak.config import FAILURE_KINDS, SoakConfig
from tasks.soak.step import SoakInputs, run
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Two hosts on a bridge, one rank on each."""
    require("netns")
    cluster = start_cluster(tmp_path_factory.mktemp("soak-hosts"), [HostSpec("host-a"), HostSpec("host-b")], "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def test_over_ssh_a_short_soak_recovers_every_injected_failure_by_its_expected_rung(
    make_spec, hosts: SshdCluster, tmp_path: Path, record_property
) -> None:
    spec = make_spec({"cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1},
                      "nodes": hosts.nodes_section(), "checkpoint": {"memory_dir": str(tmp_path / "shm")}})  # fmt: skip
    # Seed 571 over 145 s, a failure every 40 s on average, in shuffled rounds of the four kinds SSH can take: a rank
    # kill, a hang, a node loss, a slow node (at 7, 9, 14 and 49 s; each waits for the previous one's recovery). The
    # restarts come first, so the ranks the last one starts live long enough for their memory to be judged.
    soak = SoakConfig(hours=145 / 3600, failure_every_min=40 / 60, seed=571, slow_for_s=6, hang_timeout_s=8)
    result = run(SoakInputs.of(spec, spec.training_config(), soak, work_url=str(tmp_path / "work")))
    record_property("soak", result.summary())
    assert result.passed, result.problems
    assert set(result.left_out) == {"storage_outage"}
    assert {f.kind for f in result.failures} == set(FAILURE_KINDS) - {"storage_outage"}, result.failures
    assert len(result.failures) >= 3 and all(f.recovered for f in result.failures), result.failures
    restarts = [f for f in result.failures if f.kind in ("rank_kill", "hang", "node_loss")]
    # restored from host memory (or from a storage save newer than the last copy), no step lost beyond the memory
    # interval (every step): the kill may land before the step's copy is taken
    assert restarts and all(f.rung in ("memory", "storage") and f.steps_lost <= 1 for f in restarts), restarts
    assert all(f.requeued == (f.kind == "node_loss") for f in result.failures)
    assert {p.role for p in result.processes} >= {"rank 0", "rank 1"} and not result.leaks
