"""The hang drill through the SSH launcher (two hosts in network namespaces, real SSH, one rank on each) and
through the single-node Slurm test cluster: the watchdog's heartbeats and hang record reach the run's shared
folder from every host, the stalled rank is named, and the job recovers (torchrun's restart inside the job, or
the drill's relaunch where the launcher ended the job)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.hang import drill_hang
from tests.integration.nodes.conftest import require
from tests.integration.nodes.testhosts import HostSpec, SshdCluster, start_cluster
from training.watchdog import hang_records

pytestmark = pytest.mark.integration

LOOSE = {"scaling_efficiency_min": 0.01, "comm_share_max": 1.0, "correctness_max_rel_deviation": 1e-4}
SHORT = AcceptanceConfig.model_validate({"thresholds": LOOSE, "steps": 10, "save_every_steps": 3, "job_timeout_s": 300})


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Two hosts on a bridge, one rank on each."""
    require("netns")
    cluster = start_cluster(tmp_path_factory.mktemp("hang-hosts"), [HostSpec("host-a"), HostSpec("host-b")], "netns")
    try:
        yield cluster
    finally:
        cluster.close()


def _assert_found_and_restarted(result, stalled_host: str | None = None) -> None:  # noqa: ANN001
    """The drill passed: the hang was found in the stalled step, rank 1 named, both ranks' stacks dumped, and the
    watchdog's exit (HANG_EXIT_CODE) restarted by torchrun inside the same job, from the storage checkpoint."""
    assert result.passed, (result.message, result.evidence)
    evidence = result.evidence
    assert (evidence["hang"]["phase"], evidence["hang"]["late_ranks"]) == ("step", [1]), evidence["hang"]
    assert set(evidence["stacks"]) == {"0", "1"}
    assert not evidence["relaunched"] and evidence["restart"]["rung"] == "storage", evidence
    assert result.detection_s is not None and result.recovery_s is not None and result.state_matched
    if stalled_host is not None:  # the stalled rank's own record, written from its host into the shared folder
        records = {r.rank: r for r in hang_records(evidence["output_dir"]) if r.attempt == 0}
        assert records[1].host == stalled_host and records[0].host != stalled_host, records


def test_the_hang_drill_names_the_stalled_rank_across_ssh_hosts_and_the_job_recovers(
    make_spec, hosts: SshdCluster, tmp_path: Path
) -> None:
    spec = make_spec({"cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1},
                      "nodes": hosts.nodes_section()})  # fmt: skip
    result = drill_hang(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    _assert_found_and_restarted(result, stalled_host="host-b")


def test_the_hang_drill_passes_through_slurm(
    slurm_cluster: dict[str, str], make_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in slurm_cluster.items():
        monkeypatch.setenv(key, value)
    spec = make_spec({"cluster": {"scheduler": "slurm"}})
    result = drill_hang(DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT))
    _assert_found_and_restarted(result)
