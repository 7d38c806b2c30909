"""The `nodes:` spec section and the run plan: bad input is refused before any node is touched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.launch.cluster import ClusterConfig
from tasks.nodes.config import NodesConfig
from tasks.nodes.inventory import plan_checks
from tasks.spec import SpecError, load_spec, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)

BAD_NODES = [
    (
        {"hosts": [{"name": "a"}], "inventory_path": "/etc/ansible/hosts"},
        "nodes.inventory_path=/etc/ansible/hosts: set either hosts or inventory_path, not both",
    ),
    ({"hosts": [{"name": "a"}, {"name": "a"}]}, "nodes.hosts=a: host a is listed twice; list every node once"),
    ({"hosts": [{"name": "a", "port": 0}]}, "nodes.hosts.0.port=0: must be >= 1"),
    ({"hosts": [{"name": "a b"}]}, "nodes.hosts.0.name=a b: must match the pattern"),
    ({"hosts": [{"name": "a", "connection": "winrm"}]}, "nodes.hosts.0.connection=winrm: must be one of 'ssh' or"),
    ({"hosts": []}, "nodes.hosts=[]: List should have at least 1 item"),
    (
        {"ssh_key_path": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl\n"},
        "holds a key, not a path; put the key in a file (mode 0600) and give its path",
    ),
    ({"storage": [{"path": "data"}]}, "nodes.storage.0.path=data: must be an absolute path"),
    ({"storage": [{"path": "/data", "min_free_gb": 0}]}, "nodes.storage.0.min_free_gb=0: must be > 0"),
    ({"rdzv_port": 70000}, "nodes.rdzv_port=70000: must be <= 65535"),
    ({"forks": 0}, "nodes.forks=0: must be >= 1"),
    ({"max_clock_skew_s": 0}, "nodes.max_clock_skew_s=0: must be > 0"),
    ({"timeout_s": 5}, "nodes.timeout_s=5: is not a known field; remove it"),
    (
        {"python": "{{ lookup('pipe', 'id') }}"},
        "contains template syntax ({{, {% or {#), which Ansible would run on the controller; give the literal value",
    ),
    ({"inventory_pattern": "{% if 1 %}all{% endif %}"}, "contains template syntax"),
    ({"storage": [{"path": "/data/{{ x }}"}]}, "nodes.storage.0.path=/data/{{ x }}: '/data/{{ x }}' contains template"),
    ({"known_hosts_path": "/etc/known\nhosts"}, "contains a control character (newline, tab, NUL...); remove it"),
    ({"ansible_python": "python3; id"}, "nodes.ansible_python=python3; id: 'python3; id' is not a plain program path"),
    ({"python": "/usr/bin/python3\n"}, "'/usr/bin/python3\\n' contains a control character"),
    (
        {"ssh_user": "root -oProxyCommand=id"},
        "nodes.ssh_user=root -oProxyCommand=id: 'root -oProxyCommand=id' is not a",
    ),
    ({"hosts": [{"name": "a", "address": "x;id"}]}, "nodes.hosts.0.address=x;id: 'x;id' is not a host name or an IP"),
    ({"hosts": [{"name": "a\n"}]}, "must match the pattern ^[A-Za-z0-9]([A-Za-z0-9._-]{0,252})$"),
    ({"forks": 10**30}, "nodes.forks=1000000000000000000000000000000: must be <= 1000"),
    ({"run_timeout_s": 10**30}, "nodes.run_timeout_s=1000000000000000000000000000000: must be <= 604800"),
    ({"connect_timeout_s": 10**9}, "nodes.connect_timeout_s=1000000000: must be <= 3600"),
    ({"task_timeout_s": 10**9}, "nodes.task_timeout_s=1000000000: must be <= 86400"),
    ({"rdzv_connect_timeout_s": 10**9}, "nodes.rdzv_connect_timeout_s=1000000000: must be <= 3600"),
    ({"max_clock_skew_s": float("nan")}, "nodes.max_clock_skew_s=NaN: must be a finite number"),
    (
        {"storage": [{"path": "/d", "min_free_gb": float("inf")}]},
        "nodes.storage.0.min_free_gb=Infinity: must be a finite",
    ),
]


@pytest.mark.parametrize(("nodes", "expected"), BAD_NODES, ids=[e for _, e in BAD_NODES])
def test_bad_nodes_section_is_refused_naming_field_value_and_fix(nodes: dict, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(deep_merge(BASE, {"nodes": nodes}), "bad")
    assert any(expected in problem for problem in err.value.problems), err.value.problems


def test_embedded_default_spec_checks_localhost_over_the_local_connection() -> None:
    spec = load_spec(REPO / "examples" / "local.yaml")
    plan = plan_checks(spec.nodes, spec.cluster)
    assert plan.hosts == ["localhost"]
    host_vars = plan.inventory["all"]["hosts"]["localhost"]
    assert host_vars["ansible_connection"] == "local"
    assert host_vars["node_facts_job_python"] == sys.executable, "the local job runs with tdeploy's Python"
    assert plan.rdzv_port is None, "one local node picks a free port at start: nothing to test"
    assert plan.expected_gpus is None


def test_remote_scheduler_without_hosts_is_a_user_error_that_says_what_to_list() -> None:
    with pytest.raises(UserError, match="nodes.hosts is not set and cluster.scheduler=slurm") as err:
        plan_checks(NodesConfig(), ClusterConfig(scheduler="slurm", nodes=2, procs_per_node=8, accelerator="h100"))
    assert "list the nodes under nodes.hosts" in str(err.value)


def test_missing_key_file_is_refused_before_anything_runs(tmp_path: Path) -> None:
    nodes = NodesConfig(hosts=[{"name": "a"}], ssh_key_path=str(tmp_path / "id_ed25519"))
    with pytest.raises(UserError, match=r"nodes.ssh_key_path=.*id_ed25519: no such file"):
        plan_checks(nodes, ClusterConfig(procs_per_node=1))


def test_plan_carries_ssh_settings_in_the_inventory_and_role_values_as_extravars(tmp_path: Path) -> None:
    key, known = tmp_path / "key", tmp_path / "known hosts"
    key.write_text("x")
    known.write_text("x")
    nodes = NodesConfig(
        hosts=[{"name": "node-a", "address": "10.0.0.2"}, {"name": "node-b", "port": 2222}],
        ssh_user="train",
        ssh_key_path=str(key),
        known_hosts_path=str(known),
        storage=[{"path": "/data", "min_free_gb": 100}],
        python="/opt/venv/bin/python",
    )
    plan = plan_checks(nodes, ClusterConfig(scheduler="slurm", nodes=2, procs_per_node=8, accelerator="h100"))
    inventory = plan.inventory["all"]
    assert inventory["hosts"] == {
        "node-a": {"ansible_host": "10.0.0.2", "ansible_port": 22},
        "node-b": {"ansible_host": "node-b", "ansible_port": 2222},
    }
    assert inventory["vars"]["ansible_user"] == "train"
    assert inventory["vars"]["ansible_ssh_private_key_file"] == str(key)
    assert f"'UserKnownHostsFile={known}'" in inventory["vars"]["ansible_ssh_common_args"]
    assert plan.extravars["node_storage_mounts"] == [{"path": "/data", "min_free_gb": 100.0}]
    assert plan.extravars["node_network_rdzv_host"] == "node-a"
    assert plan.extravars["node_network_rdzv_port"] == 29500, "several nodes and no port set: torchrun's default"
    assert plan.extravars["node_facts_job_python"] == "/opt/venv/bin/python"
    assert plan.expected_gpus == 8 and plan.min_hosts == 2


def test_rendezvous_port_comes_from_nodes_then_cluster() -> None:
    two = [{"name": "a"}, {"name": "b"}]
    cluster = ClusterConfig(procs_per_node=1, nodes=2, rdzv_port=29400)
    assert plan_checks(NodesConfig(hosts=two), cluster).rdzv_port == 29400
    assert plan_checks(NodesConfig(hosts=two, rdzv_port=29600), cluster).rdzv_port == 29600
