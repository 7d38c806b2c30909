"""From the spec to one playbook run: the inventory, the role variables (extravars) and the limits."""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tasks.errors import UserError
from tasks.hosts import NodeHost
from tasks.launch.cluster import ClusterConfig
from tasks.launch.registry import capabilities, launcher_class
from tasks.nodes import runner
from tasks.nodes.config import NodesConfig

TORCHRUN_DEFAULT_PORT = 29500


@dataclass(frozen=True)
class CheckPlan:
    """Everything one run of the node checks needs, worked out and checked before anything runs."""

    inventory: dict[str, Any]
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
    """The spec's hosts; when none are given, the launcher's where the job runs on this machine only (localhost
    over the local connection): other hosts need the nodes section's connection settings."""
    if nodes.hosts is not None or nodes.inventory_path is not None:
        return nodes.hosts
    launcher = launcher_class(cluster.scheduler)
    hosts = launcher.hosts(cluster) if launcher.capabilities.runs_on_this_machine_only else None
    if hosts is not None:
        return hosts
    raise UserError(
        f"nodes.hosts is not set and cluster.scheduler={cluster.scheduler} runs on other machines",
        "list the nodes under nodes.hosts (name, address, port) or give an Ansible inventory in nodes.inventory_path",
    )


def rendezvous_port(nodes: NodesConfig, cluster: ClusterConfig, n_hosts: int | None) -> int | None:
    """The port to test: nodes.rdzv_port, else the job's (as its launcher says: cluster.slurm.rdzv_port under
    Slurm, else cluster.rdzv_port), else torchrun's default when several nodes meet."""
    if nodes.rdzv_port is not None:
        return nodes.rdzv_port
    port = launcher_class(cluster.scheduler).rdzv_port(cluster)
    if port is not None:
        return port
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


MAX_INVENTORY_BYTES = 16 << 20
_TEMPLATE = re.compile(r"\{\{|\{%|\{#")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Connection variables an inventory on shared storage may set: where and as whom to reach a node over SSH. The
# others put programs or options on this machine's command lines (ansible_ssh_common_args with a ProxyCommand,
# ansible_ssh_executable) or run the checks here (ansible_connection=local); those come from the spec's own fields.
INVENTORY_CONNECTION_VARS = frozenset(
    {"ansible_host", "ansible_port", "ansible_user", "ansible_python_interpreter", "ansible_connection"}
)
_REMOTE_CONNECTIONS = frozenset({"ssh", "ansible.builtin.ssh", "smart"})


def _inventory_error(path: str, file: Path, what: str, fix: str) -> UserError:
    return UserError(f"nodes.inventory_path={path}: in {file}, {what}", fix)


def _text_problem(text: str) -> str | None:
    if _TEMPLATE.search(text):
        return "holds template syntax ({{, {% or {#) that Ansible would run on this machine"
    if _CONTROL.search(text):
        return "holds a control character (newline, NUL, escape...)"
    return None


def _value_problems(value: Any, where: str) -> list[tuple[str, str, str]]:
    """(where, the text, what is wrong) for every string in `value`, dictionary keys included."""
    if isinstance(value, str):
        problem = _text_problem(value)
        return [(where, value, problem)] if problem else []
    if isinstance(value, dict):
        found = [p for key in value for p in _value_problems(str(key), f"a key in {where}")]
        return found + [p for key, item in value.items() for p in _value_problems(item, f"{where}.{key}")]
    if isinstance(value, list):
        return [p for index, item in enumerate(value) for p in _value_problems(item, f"{where}[{index}]")]
    return []


def _static_file(path: str) -> Path:
    """The inventory file, if Ansible would only read it: a regular file, not executable, not a plugin's config."""
    file = Path(_existing_file(path, "inventory_path", "give the path of an Ansible inventory"))
    fix = "give a static INI or YAML inventory of the nodes, or list them under nodes.hosts"
    if file.stat().st_mode & 0o111:
        raise _inventory_error(
            path,
            file,
            "the file is executable: Ansible would run it on this machine as an inventory script",
            fix + " (chmod a-x it if it is one)",
        )
    if file.stat().st_size > MAX_INVENTORY_BYTES:
        raise _inventory_error(path, file, f"the file is larger than {MAX_INVENTORY_BYTES >> 20} MiB", fix)
    try:
        loaded = yaml.safe_load(file.read_bytes())
    except (yaml.YAMLError, ValueError, RecursionError):
        loaded = None  # not YAML (an INI inventory): Ansible's INI parser reads it
    if isinstance(loaded, dict) and "plugin" in loaded:
        raise _inventory_error(
            path,
            file,
            f"plugin: {str(loaded['plugin'])[:100]!r} configures an inventory plugin, which runs code on this machine",
            fix,
        )
    return file


def read_inventory(path: str) -> dict[str, Any]:
    """The nodes of the inventory file at `path` (nodes.inventory_path, on storage others may write) as inventory
    data: groups in their order, each host with its merged variables. Refuses what Ansible would run on this
    machine: an inventory script or plugin, template syntax in any name or value, and connection variables beyond
    host, port, user, remote Python and an SSH connection."""
    file = _static_file(path)
    listed = runner.list_inventory(file)
    host_vars: dict[str, dict[str, Any]] = (listed.pop("_meta", None) or {}).get("hostvars") or {}
    problems: list[tuple[str, str, str]] = []
    connection: list[tuple[str, str, str]] = []
    for group, entry in listed.items():
        problems += _value_problems(group, "group name")
        problems += [p for host in entry.get("hosts") or [] for p in _value_problems(host, "host name")]
    for host, variables in host_vars.items():
        problems += _value_problems(host, "host name")
        for name, value in variables.items():
            where = f"variable {name} of host {host} (set on the host or a group)"
            problems += _value_problems(name, f"a variable name of host {host}") + _value_problems(value, where)
            if name.startswith("ansible_") and name not in INVENTORY_CONNECTION_VARS:
                connection.append((where, str(value), "sets how Ansible runs on this machine"))
            elif name == "ansible_connection" and str(value) not in _REMOTE_CONNECTIONS:
                connection.append((where, str(value), "runs the checks on this machine, not over SSH"))
    problems += connection
    if problems:
        where, text, what = problems[0]
        more = f" ({len(problems) - 1} more problem(s) after this one)" if len(problems) > 1 else ""
        raise _inventory_error(
            path,
            file,
            f"{where} is {text[:200]!r}, which {what}{more}",
            "write literal values, and only ansible_host, ansible_port, ansible_user, ansible_python_interpreter and "
            "ansible_connection=ssh among Ansible's variables (SSH options come from nodes.ssh_key_path and "
            "nodes.known_hosts_path), or list the nodes under nodes.hosts",
        )
    return _inventory_data(listed, host_vars)


def _inventory_data(listed: dict[str, Any], host_vars: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The YAML-inventory form of `ansible-inventory --list`'s output: every host with its variables under `all`
    (in the order the groups list them), and each group with its hosts and child groups."""
    order: dict[str, None] = {}  # insertion-ordered set
    groups: dict[str, Any] = {}

    def walk(group: str, seen: set[str]) -> None:
        entry = listed.get(group) or {}
        order.update(dict.fromkeys(entry.get("hosts") or []))
        for child in entry.get("children") or []:
            if child not in seen:
                walk(child, seen | {child})

    walk("all", {"all"})
    for group, entry in listed.items():
        if group != "all":
            groups[group] = {
                "hosts": {host: {} for host in entry.get("hosts") or []},
                "children": {child: {} for child in entry.get("children") or []},
            }
    order.update(dict.fromkeys(host_vars))
    return {"all": {"hosts": {host: host_vars.get(host, {}) for host in order}, "children": groups}}


def plan_checks(nodes: NodesConfig, cluster: ClusterConfig) -> CheckPlan:
    """Work out one run from the spec's `nodes` and `cluster` sections; UserError for what cannot work."""
    hosts = default_hosts(nodes, cluster)
    if hosts is not None:
        inventory = build_inventory(nodes, hosts)
        names: list[str] | None = [h.name for h in hosts]
        pattern, extra_connection = "all", {}
    else:
        assert nodes.inventory_path is not None
        inventory = read_inventory(nodes.inventory_path)
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
        min_hosts=None if capabilities(cluster.scheduler).runs_on_this_machine_only else cluster.nodes,
        interface=cluster.network.interface,
    )
