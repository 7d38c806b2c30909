"""The Slurm launcher on a real multi-node Slurm cluster: one torchrun agent per host, one rank per host."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tasks.launch.base import JobState, wait_for
from tasks.launch.slurm import SlurmLauncher
from tests.integration.multinode.conftest import HOST_NAMES, SlurmMultinode
from training.run_output import RunOutput

pytestmark = pytest.mark.integration


def test_every_host_runs_its_own_slurmd_under_its_own_host_name(slurm_multinode: SlurmMultinode) -> None:
    assert slurm_multinode.sinfo_states() == dict.fromkeys(HOST_NAMES, "idle")
    for host in slurm_multinode.hosts.hosts:
        seen = subprocess.run(host.enter(["hostname"]), capture_output=True, text=True, check=True).stdout
        assert seen.strip() == host.name


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_training_job_spans_the_hosts_with_one_rank_on_each(
    slurm_multinode: SlurmMultinode, make_spec, nodes: int
) -> None:
    shared = slurm_multinode.hosts.shared / f"job-{nodes}-nodes"
    spec = make_spec(
        {
            "cluster": {
                "scheduler": "slurm",
                "nodes": nodes,
                "procs_per_node": 1,
                "env": {"GLOO_SOCKET_IFNAME": "eth0"},  # the hosts' link to each other (lo is per host)
            },
            "run": {"steps": 4, "output_url": str(shared / "output")},
            "checkpoint": {"url": str(shared / "checkpoints"), "save_every_steps": 4},
        }
    )
    launcher = SlurmLauncher(slurm_multinode.env)
    handle = launcher.submit(spec.cluster, spec.training_config(), f"tdeploy-{nodes}-nodes")
    status = wait_for(launcher, handle, timeout_s=300)
    assert status.state is JobState.SUCCEEDED, "\n".join(launcher.logs(handle)[0][-40:]) + slurm_multinode.logs()

    ranks = RunOutput(spec.run.output_url).ranks()
    assert ranks is not None and ranks.world_size == nodes
    hosts = [r["host"] for r in ranks.ranks]
    assert len(set(hosts)) == nodes, f"one rank per host, got {hosts}"
    assert set(hosts) <= set(HOST_NAMES), hosts
    assert (Path(spec.checkpoint.url) / "step-00000004" / "COMMIT.json").exists()
    node_logs = Path(spec.run.output_url, "logs").glob("*/*/attempt_0/*/stderr.log")
    assert {p.relative_to(spec.run.output_url).parts[1] for p in node_logs} == set(hosts), "each host's own logs"
