"""Spec values are data to Ansible: a Jinja lookup in them never runs on the controller (ansible-core 2.19), and
shell syntax in them never runs on a node.

The spec refuses template syntax at its boundary; these tests go around that boundary (`model_copy`
does not validate) to prove the second line of defence: the runner marks every inventory and extravars
string unsafe (an inventory file's too, once read as data). `test_without_the_unsafe_marking_the_same_lookup_would_run`
shows that the same values, not marked, do run: that is what the marking prevents, and what makes the other tests
able to fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tasks.nodes.inventory as inventory_module
import tasks.nodes.runner as runner
from tasks.nodes.config import NodesConfig, StorageMount
from tasks.nodes.inventory import plan_checks
from tasks.nodes.runner import run_playbook
from tests.integration.nodes.conftest import free_port, two_node_cluster
from tests.integration.nodes.testhosts import SshdCluster

pytestmark = pytest.mark.integration


def pipe_lookup(marker: Path) -> str:
    """A value that creates `marker` on the controller if Ansible templates it."""
    return "{{ lookup('ansible.builtin.pipe', 'touch " + str(marker) + "') }}"


def run(nodes: NodesConfig):  # noqa: ANN201 - PlaybookRun
    plan = plan_checks(nodes, two_node_cluster())
    return run_playbook(
        plan.inventory, plan.extravars, forks=2, connect_timeout_s=5, task_timeout_s=60, run_timeout_s=180
    )


def test_a_pipe_lookup_in_the_job_python_and_a_mount_path_does_not_run_on_the_controller(
    consistent: SshdCluster, tmp_path: Path
) -> None:
    python_marker, mount_marker = tmp_path / "from-python", tmp_path / "from-mount"
    nodes = NodesConfig(**consistent.nodes_section()).model_copy(
        update={
            "python": pipe_lookup(python_marker) + consistent.job_python,
            "storage": [StorageMount(path="/tmp").model_copy(update={"path": "/tmp/" + pipe_lookup(mount_marker)})],
        }
    )
    result = run(nodes)
    assert not python_marker.exists() and not mount_marker.exists(), "a spec value ran as a template"
    assert set(result.results) == {"node-a", "node-b"}, result.stdout[-2000:]
    for host in ("node-a", "node-b"):
        assert result.results[host]["facts"]["job_python"] == nodes.python, "the value reached the node literally"


def test_a_pipe_lookup_in_an_inventory_value_does_not_run_on_the_controller(
    consistent: SshdCluster, tmp_path: Path
) -> None:
    marker = tmp_path / "from-ssh-user"
    nodes = NodesConfig(**consistent.nodes_section()).model_copy(update={"ssh_user": pipe_lookup(marker) + "root"})
    result = run(nodes)
    assert not marker.exists(), "an inventory value ran as a template"
    assert set(result.unreachable) == {"node-a", "node-b"}, "the literal user name cannot log in"


def test_without_the_unsafe_marking_the_same_lookup_would_run(
    consistent: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "unmarked"
    monkeypatch.setattr(runner, "ansible_unsafe", lambda value: value)
    nodes = NodesConfig(**consistent.nodes_section()).model_copy(
        update={"python": pipe_lookup(marker) + consistent.job_python}
    )
    run(nodes)
    assert marker.exists(), "ansible-core no longer templates extravars: the unsafe marking may be unneeded"


def test_a_rendezvous_address_with_shell_syntax_reaches_the_nodes_shell_quoted(
    consistent: SshdCluster, tmp_path: Path
) -> None:
    marker = tmp_path / "from-rdzv-address"  # the test nodes share this machine's filesystem
    address = f"node-a$(touch {marker});touch {marker}"
    plan = plan_checks(NodesConfig(**consistent.nodes_section(rdzv_port=free_port())), two_node_cluster())
    result = run_playbook(
        plan.inventory,
        {**plan.extravars, "node_network_rdzv_address": address},
        forks=2,
        connect_timeout_s=5,
        task_timeout_s=60,
        run_timeout_s=180,
    )
    assert not marker.exists(), "the address ran as shell syntax on a node"
    connect = result.results["node-b"]["network"]["connect"]
    assert connect["connected"] is False and f"cannot resolve {address}" in connect["error"], connect


def test_a_template_in_an_inventory_file_that_got_past_the_check_is_passed_as_data_and_never_runs(
    consistent: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "from-inventory-file"
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[trainers]\n"
        + "".join(f"{h.name} ansible_port={h.port}\n" for h in consistent.hosts)
        + f'[trainers:vars]\nansible_host="{pipe_lookup(marker)}127.0.0.2"\n'
    )
    monkeypatch.setattr(inventory_module, "_text_problem", lambda text: None)  # the first line of defence, off
    section = consistent.nodes_section()
    del section["hosts"]
    result = run(NodesConfig(**section, inventory_path=str(inventory)))
    assert not marker.exists(), "a template from the inventory file ran on the controller"
    assert set(result.unreachable) == {"node-a", "node-b"}, "the literal address reaches no node"
