"""Replica groups on the SSH launcher: the spec allows them with one group per host, and each host's command runs its
own group (the first host the lighthouse too, kept until the other groups' exit files are there)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tasks.launch.ssh import SshLauncher
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge

HOSTS = [{"name": "node-a", "address": "10.0.0.2"}, {"name": "node-b", "address": "10.0.0.3", "port": 2222}]


def _spec(cluster: dict | None = None, fault_tolerance: dict | None = None):
    raw = {
        "data": {"dataset_url": "/data/ds"},
        "checkpoint": {"url": "/shared/ck"},
        "run": {"output_url": "/shared/o"},
        "nodes": {"hosts": HOSTS, "python": "/opt/venv/bin/python"},
        "cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1, "max_restarts": 1, **(cluster or {})},
        "fault_tolerance": {"mode": "replica_groups", **(fault_tolerance or {})},
    }
    return parse_spec(deep_merge(TINY_SPEC, raw), "tiny")


def test_an_ssh_spec_runs_replica_groups_one_per_host() -> None:
    spec = _spec()
    assert spec.training_config().fault_tolerance.replica_groups == 2


def test_more_groups_than_hosts_is_refused_with_the_fix() -> None:
    with pytest.raises(SpecError) as caught:
        _spec({"procs_per_node": 2}, {"replica_groups": 4})
    assert any(
        p.startswith("fault_tolerance.replica_groups=4: must equal cluster.nodes=2 on the ssh launcher (each node or host")
        and "set fault_tolerance.replica_groups to 2, or cluster.nodes to 4" in p
        for p in caught.value.problems
    ), caught.value.problems


def _host_command(node: int) -> list[str]:
    """The words the host `node`'s shell runs for a replica-groups job (after `cd DIR && exec env VAR=...`)."""
    spec = _spec({"procs_per_node": 2})
    argv, _ = SshLauncher(env={})._replica_command(
        spec.cluster, spec.training_config("/data/ds"), "job-1", Path("/shared/o/run.json"), None, node
    )
    assert argv[-2] == f"root@{HOSTS[node]['address']}" or argv[-2] == HOSTS[node]["address"]
    words = shlex.split(argv[-1])
    return words[words.index("/opt/venv/bin/python") :]


def test_each_host_runs_its_own_group_and_the_first_host_the_lighthouse_until_the_others_exit() -> None:
    first, second = _host_command(0), _host_command(1)
    for node, words in enumerate((first, second)):
        assert words[:3] == ["/opt/venv/bin/python", "-m", "tasks.launch.replica_host"]
        assert f"--group={node}" in words and f"--host={HOSTS[node]['address']}" in words
        assert "--lighthouse-host=10.0.0.2" in words and "--lighthouse-port=29500" in words  # the first host's
        assert "--procs-per-group=2" in words and "--max-restarts=1" in words
        assert "--stop-file=/shared/o/cancelled" in words and "--workdir=/shared/o/replicas" in words
    assert "--start-lighthouse" in first and "--wait-for=/shared/o/exit-1.txt" in first
    assert not any(w.startswith(("--start-lighthouse", "--wait-for")) for w in second)
