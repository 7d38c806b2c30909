"""scheduler=ssh: the hosts come from the nodes section, the spec refuses what cannot start, and what reaches the
hosts' shells is quoted word by word."""

from __future__ import annotations

import shlex

import pytest

from tasks.errors import UserError
from tasks.hosts import NodeHost
from tasks.launch.cluster import ClusterConfig
from tasks.launch.config import SshLaunchConfig
from tasks.launch.ssh import launch_config, remote_command, ssh_command
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge

HOSTS = [{"name": "node-a", "address": "10.0.0.2"}, {"name": "node-b", "address": "10.0.0.3", "port": 2222}]
SSH = {"cluster": {"scheduler": "ssh", "nodes": 2, "procs_per_node": 1}}


def _spec(overrides: dict):
    paths = {
        "data": {"dataset_url": "/data/ds"},
        "checkpoint": {"url": "/shared/ck"},
        "run": {"output_url": "/shared/o"},
    }
    return parse_spec(deep_merge(deep_merge(deep_merge(TINY_SPEC, paths), SSH), overrides), "tiny")


def test_the_agents_hosts_and_ssh_settings_come_from_the_nodes_section() -> None:
    nodes = {"hosts": HOSTS, "ssh_user": "trainer", "ssh_key_path": "/keys/id", "python": "/opt/venv/bin/python"}
    ssh = _spec({"nodes": nodes}).cluster.ssh
    assert ssh is not None and [(h.name, h.address, h.port) for h in ssh.hosts] == [
        ("node-a", "10.0.0.2", 22), ("node-b", "10.0.0.3", 2222),
    ]  # fmt: skip
    assert (ssh.user, ssh.key_path, ssh.python) == ("trainer", "/keys/id", "/opt/venv/bin/python")


def test_an_explicit_cluster_ssh_section_wins_over_the_nodes_section() -> None:
    spec = _spec({"nodes": {"hosts": HOSTS}, "cluster": {"ssh": {"hosts": [HOSTS[1], HOSTS[0]]}}})
    assert [h.name for h in spec.cluster.ssh.hosts] == ["node-b", "node-a"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, "cluster.ssh=null: cluster.scheduler=ssh starts one torchrun agent per host: list the hosts under"),
        ({"nodes": {"hosts": HOSTS[:1]}}, "cluster.nodes=2: cluster.scheduler=ssh has 1 host(s) to start agents on"),
        (
            {"nodes": {"hosts": HOSTS}, "run": {"output_url": "s3://b/o"}},
            "run.output_url=s3://b/o: cluster.scheduler=ssh",
        ),
        ({"cluster": {"ssh": {"hosts": HOSTS, "workdir": "relative/dir"}}}, "cluster.ssh.workdir=relative/dir:"),
        ({"cluster": {"ssh": {"hosts": HOSTS, "python": "python; rm -rf /"}}}, "cluster.ssh.python=python; rm -rf /:"),
        ({"cluster": {"ssh": {"hosts": [{"name": "a b"}]}}}, "cluster.ssh.hosts.0.name=a b:"),
    ],
    ids=["no-hosts", "too-few-hosts", "object-store-output", "relative-workdir", "shell-in-python", "bad-host-name"],
)
def test_an_ssh_spec_that_cannot_start_is_refused_naming_the_field(overrides: dict, expected: str) -> None:
    with pytest.raises(SpecError) as caught:
        _spec(overrides)
    assert any(p.startswith(expected) for p in caught.value.problems), caught.value.problems


def test_what_reaches_a_hosts_shell_is_quoted_word_by_word() -> None:
    hostile = "x'; touch /tmp/pwned; echo '$(id)` \"\\"
    remote = remote_command("/shared/my project", {"JOB_NOTE": hostile}, ["/opt/py", "-m", "tasks.launch.agent"])
    words = shlex.split(remote)
    assert words[:4] == ["cd", "/shared/my project", "&&", "exec"]  # the remote shell sees exactly these words
    assert words[4:] == ["env", f"JOB_NOTE={hostile}", "/opt/py", "-m", "tasks.launch.agent"]


def test_the_ssh_command_checks_host_keys_uses_the_key_only_and_probes_the_link() -> None:
    ssh = SshLaunchConfig(hosts=[NodeHost(name="node-b", address="10.0.0.3", port=2222)], user="trainer",
                          key_path="/keys/id", known_hosts_path="/keys/known")  # fmt: skip
    argv = ssh_command(ssh, ssh.hosts[0], "true")
    options = {argv[i + 1] for i, word in enumerate(argv) if word == "-o"}
    assert {"BatchMode=yes", "StrictHostKeyChecking=yes", "IdentitiesOnly=yes", "UserKnownHostsFile=/keys/known",
            "ServerAliveInterval=5", "ServerAliveCountMax=3"} <= options  # fmt: skip
    assert argv[argv.index("-p") + 1] == "2222" and argv[-3:] == ["--", "trainer@10.0.0.3", "true"]


def test_a_cluster_without_enough_hosts_is_refused_by_the_launcher_too() -> None:
    one = SshLaunchConfig(hosts=[NodeHost(name="node-a")])
    with pytest.raises(UserError, match=r"cluster.nodes=2: cluster.ssh lists 1 host\(s\)"):
        launch_config(ClusterConfig(scheduler="ssh", nodes=2, procs_per_node=1, ssh=one))
