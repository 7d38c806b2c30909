"""An inventory file (nodes.inventory_path) may sit on storage others can write: it is read as data, and whatever
would make Ansible run code on this machine is refused before any playbook starts.

The reproduction of issue 39 item 1: before, `tdeploy check-nodes` handed the file to Ansible as it was, and a
template in a group's variables ran on the controller (the marker file appeared; the check said "1 node ready").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.launch.cluster import ClusterConfig
from tasks.nodes.check import run_node_checks
from tasks.nodes.config import NodesConfig
from tasks.nodes.inventory import plan_checks, read_inventory

SLURM = ClusterConfig(scheduler="slurm", nodes=2, procs_per_node=1)


def pipe_lookup(marker: Path) -> str:
    """A value that creates `marker` on this machine if Ansible templates it."""
    return "{{ lookup('pipe', 'touch " + str(marker) + "') }}"


def test_a_template_in_a_groups_variables_never_runs_and_is_refused_naming_file_host_variable_and_fix(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran"
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[trainers]\nnode-a ansible_port=2222\n"
        f'[trainers:vars]\nansible_host="{pipe_lookup(marker)}localhost"\n'
    )
    nodes = NodesConfig(inventory_path=str(inventory), check_password_auth=False, run_timeout_s=120)
    with pytest.raises(UserError) as err:
        run_node_checks(nodes, SLURM)
    assert not marker.exists(), "the inventory's template ran on the controller"
    message = str(err.value)
    assert message.startswith(f"nodes.inventory_path={inventory}: in {inventory}, variable ansible_host of host node-a")
    assert "template syntax ({{, {% or {#) that Ansible would run on this machine" in message
    assert "localhost" in message and "write literal values" in message and "nodes.hosts" in message


def test_template_syntax_in_a_yaml_inventorys_nested_key_or_group_vars_folder_is_refused(tmp_path: Path) -> None:
    nested = tmp_path / "nested.yml"
    nested.write_text("all:\n  hosts:\n    node-a:\n      labels: {'{# x #}': 1}\n")
    with pytest.raises(UserError, match=r"a key in variable labels of host node-a .* is '\{# x #\}'"):
        read_inventory(str(nested))
    plain = tmp_path / "site" / "hosts.ini"
    (tmp_path / "site" / "group_vars").mkdir(parents=True)
    plain.write_text("[gpu]\nnode-b\n")
    (tmp_path / "site" / "group_vars" / "gpu.yml").write_text('note: "{% if true %}x{% endif %}"\n')
    with pytest.raises(UserError, match="variable note of host node-b"):
        read_inventory(str(plain))


def test_an_executable_inventory_is_refused_without_being_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "inventory.sh"
    script.write_text(f'#!/bin/sh\ntouch {marker}\necho \'{{"all": {{"hosts": ["node-a"]}}}}\'\n')
    script.chmod(0o755)
    with pytest.raises(UserError) as err:
        plan_checks(NodesConfig(inventory_path=str(script)), SLURM)
    assert not marker.exists(), "the inventory script ran"
    assert f"nodes.inventory_path={script}: in {script}, the file is executable" in str(err.value)
    assert "give a static INI or YAML inventory" in str(err.value)


def test_an_inventory_plugin_configuration_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "cloud.yml"
    config.write_text("plugin: ansible.builtin.constructed\nstrict: false\n")
    with pytest.raises(UserError, match=r"plugin: 'ansible.builtin.constructed' configures an inventory plugin"):
        read_inventory(str(config))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("node-a ansible_ssh_common_args='-o ProxyCommand=\"touch /tmp/x\"'", "ansible_ssh_common_args of host node-a"),
        ("node-a ansible_ssh_executable=/tmp/evil", "ansible_ssh_executable of host node-a"),
        ("node-a ansible_connection=local", "is 'local', which runs the checks on this machine, not over SSH"),
    ],
    ids=["proxy-command", "ssh-executable", "local-connection"],
)
def test_connection_variables_that_run_programs_on_this_machine_are_refused(
    tmp_path: Path, line: str, expected: str
) -> None:
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(line + "\n")
    with pytest.raises(UserError, match="only ansible_host, ansible_port, ansible_user") as err:
        read_inventory(str(inventory))
    assert expected in str(err.value)


def test_a_plain_inventory_reaches_the_run_as_data_with_its_groups_order_and_merged_variables(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[trainers]\nnode-b ansible_host=10.0.0.2\nnode-a ansible_host=10.0.0.1 ansible_port=2222\n"
        "[trainers:vars]\nansible_user=trainer\n[others]\nnot-a-trainer ansible_host=192.0.2.1\n"
    )
    plan = plan_checks(NodesConfig(inventory_path=str(inventory), inventory_pattern="trainers"), SLURM)
    assert isinstance(plan.inventory, dict), "the file itself never reaches Ansible"
    hosts = plan.inventory["all"]["hosts"]
    assert list(hosts) == ["node-b", "node-a", "not-a-trainer"], "inventory order"
    assert hosts["node-a"] == {"ansible_host": "10.0.0.1", "ansible_port": 2222, "ansible_user": "trainer"}
    assert hosts["not-a-trainer"] == {"ansible_host": "192.0.2.1"}
    assert list(plan.inventory["all"]["children"]["trainers"]["hosts"]) == ["node-b", "node-a"]
    assert plan.extravars["tdeploy_nodes_pattern"] == "trainers"
