"""From the spec to one playbook run: the inventory, the role variables (extravars) and the limits."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.cluster import ClusterConfig
from tasks.errors import UserError
from tasks.nodes.config import NodeHost, NodesConfig

TORCHRUN_DEFAULT_PORT = 29500


@dataclass(frozen=True)
class CheckPlan:
    """Everything one run of the node checks needs, worked out and checked before anything runs."""

    inventory: dict[str, Any] | str
    extravars: dict[str, Any]
    hosts: list[str] | None
    forks: int
    connect_timeout_s: int
    task_timeout_s: int
    run_timeout_s: int | None
    expected_gpus: int | None
    rdzv_port: int | None
    max_clock_skew_s: float
    job_python: str
    min_hosts: int | None = None
    interface: str | None = None


def default_hosts(nodes: NodesConfig, cluster: ClusterConfig) -> list[NodeHost] | None:
    """The spec's hosts; localhost over the local connection for the local scheduler when none are given."""
    if nodes.hosts is not None or nodes.inventory_path is not None:
        return nodes.hosts
    if cluster.scheduler == "local":
        return [NodeHost(name="localhost", connection="local")]
    raise UserError(
        f"nodes.hosts is not set and cluster.scheduler={cluster.scheduler} runs on other machines",
        "list the nodes under nodes.hosts (name, address, port) or give an Ansible inventory in nodes.inventory_path",
    )


def rendezvous_port(nodes: NodesConfig, cluster: ClusterConfig, n_hosts: int | None) -> int | None:
    """The port to test: nodes.rdzv_port, else the job's (cluster.slurm.rdzv_port under Slurm, else
    cluster.rdzv_port), else torchrun's default when several nodes meet."""
    if nodes.rdzv_port is not None:
        return nodes.rdzv_port
    if cluster.scheduler == "slurm":
        return cluster.slurm.rdzv_port
    if cluster.rdzv_port is not None:
        return cluster.rdzv_port
    return TORCHRUN_DEFAULT_PORT if n_hosts is None or n_hosts > 1 else None


def _existing_file(path: str, field_name: str, fix: str) -> str:
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise UserError(f"nodes.{field_name}={path}: no such file", fix)
    return str(resolved.resolve())


def connection_vars(nodes: NodesConfig) -> dict[str, Any]:
    """Ansible connection variables from the spec: SSH user, key file, known_hosts, Python on the nodes."""
    found: dict[str, Any] = {}
    if nodes.ssh_user is not None:
        found["ansible_user"] = nodes.ssh_user
    if nodes.ansible_python is not None:
        found["ansible_python_interpreter"] = nodes.ansible_python
    if nodes.ssh_key_path is not None:
        found["ansible_ssh_private_key_file"] = _existing_file(
            nodes.ssh_key_path, "ssh_key_path", "give the path of the SSH private key on this machine"
        )
    if nodes.known_hosts_path is not None:
        known_hosts = _existing_file(
            nodes.known_hosts_path, "known_hosts_path", "give a known_hosts file with the nodes' host keys"
        )
        found["ansible_ssh_common_args"] = shlex.join(
            ["-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes"]
        )
    return found


def build_inventory(nodes: NodesConfig, hosts: list[NodeHost]) -> dict[str, Any]:
    """An Ansible inventory (as data; ansible-runner hands it to Ansible) for the spec's hosts."""
    host_vars: dict[str, dict[str, Any]] = {}
    for host in hosts:
        entry: dict[str, Any]
        if host.connection == "local":
            # The local scheduler runs the job with the Python that runs tdeploy.
            entry = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
            if nodes.python is None:
                entry["node_facts_job_python"] = sys.executable
        else:
            entry = {"ansible_host": host.address or host.name, "ansible_port": host.port}
        host_vars[host.name] = entry
    return {"all": {"hosts": host_vars, "vars": connection_vars(nodes)}}


def plan_checks(nodes: NodesConfig, cluster: ClusterConfig) -> CheckPlan:
    """Work out one run from the spec's `nodes` and `cluster` sections; UserError for what cannot work."""
    hosts = default_hosts(nodes, cluster)
    if hosts is not None:
        inventory: dict[str, Any] | str = build_inventory(nodes, hosts)
        names: list[str] | None = [h.name for h in hosts]
        pattern, extra_connection = "all", {}
    else:
        assert nodes.inventory_path is not None
        inventory = _existing_file(nodes.inventory_path, "inventory_path", "give the path of an Ansible inventory")
        names, pattern = None, nodes.inventory_pattern
        # The spec's SSH settings apply to every node of the inventory: extravars win over inventory values.
        extra_connection = connection_vars(nodes)
    port = rendezvous_port(nodes, cluster, len(names) if names is not None else None)
    extravars: dict[str, Any] = {
        "tdeploy_nodes_pattern": pattern,
        "node_facts_command_timeout_s": min(30, nodes.task_timeout_s),
        "node_storage_mounts": [m.model_dump() for m in nodes.storage],
        "node_network_rdzv_host": names[0] if names else None,
        "node_network_rdzv_address": nodes.rdzv_address,
        "node_network_rdzv_port": port,
        "node_network_connect_timeout_s": nodes.rdzv_connect_timeout_s,
        "node_network_interface": cluster.network.interface,
        "node_security_check_password_auth": nodes.check_password_auth,
        "node_security_connect_timeout_s": nodes.connect_timeout_s,
    }
    if nodes.python is not None:
        extravars["node_facts_job_python"] = nodes.python
    extravars.update(extra_connection)
    return CheckPlan(
        inventory=inventory,
        extravars=extravars,
        hosts=names,
        forks=nodes.forks,
        connect_timeout_s=nodes.connect_timeout_s,
        task_timeout_s=nodes.task_timeout_s,
        run_timeout_s=nodes.run_timeout_s,
        expected_gpus=cluster.procs_per_node if cluster.accelerator != "cpu" else None,
        rdzv_port=port,
        max_clock_skew_s=nodes.max_clock_skew_s,
        job_python=nodes.python or "python3",
        min_hosts=cluster.nodes if cluster.scheduler != "local" else None,
        interface=cluster.network.interface,
    )
