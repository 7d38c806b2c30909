"""The settings that keep the node checks fast, read back as Ansible sees them, and the code that replaced modules.

The effective configuration comes from `ansible-config dump` in the environment a run gets; the plays'
strategies from the playbook; the SSH login-methods probe and the node probes are called directly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tasks.nodes.runner import PLAYBOOK, PLAYBOOKS, ansible_environment
from tests.unit.nodes.conftest import ANSIBLE_PATCH_TARGETS, load_role_file

ROLES = ["node_facts", "node_storage", "node_network", "node_security"]


def effective_config(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(base settings, ssh connection settings) that ansible-playbook uses in a run's environment."""
    env = ansible_environment(tmp_path, connect_timeout_s=7, task_timeout_s=90, control_dir=tmp_path / "cp")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-config"), "dump", "--format", "json", "-t", "all"],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    dump = json.loads(proc.stdout)
    base = {entry["name"]: entry["value"] for entry in dump if "name" in entry}
    plugins = next(entry["CONNECTION_PLUGINS"] for entry in dump if "CONNECTION_PLUGINS" in entry)
    ssh = next(plugin["ssh"] for plugin in plugins if "ssh" in plugin)
    return base, {entry["name"]: entry["value"] for entry in ssh}


def test_a_run_pipelines_modules_over_one_persistent_ssh_connection_per_node(tmp_path: Path) -> None:
    base, ssh = effective_config(tmp_path)
    assert base["CONFIG_FILE"] == str(PLAYBOOKS / "ansible.cfg")
    assert ssh["pipelining"] is True, "modules go over ssh's stdin: no temporary files, one session per module"
    assert "ControlMaster=auto" in ssh["ssh_args"] and "ControlPersist=" in ssh["ssh_args"]
    assert ssh["control_path_dir"] == str(tmp_path / "cp"), "the run's own sockets, closed at its end"
    assert ssh["use_tty"] is False, "raw commands (the clock) need no pseudo-terminal"
    assert "BatchMode=yes" in ssh["ssh_args"] and "PasswordAuthentication=no" in ssh["ssh_args"]
    assert base["DEFAULT_GATHERING"] == "explicit", "facts are gathered by node_facts' probe, for the subsets used"
    assert (base["DEFAULT_TIMEOUT"], base["TASK_TIMEOUT"]) == (7, 90)


def test_the_per_node_checks_run_free_and_the_network_checks_in_step() -> None:
    plays = yaml.safe_load(PLAYBOOK.read_text())
    assert len(plays) == 2, "one playbook run, two plays"
    per_node, network = plays
    assert per_node["strategy"] == "ansible.builtin.free"
    assert [r["role"] for r in per_node["roles"]] == ["node_facts", "node_storage", "node_security"]
    assert per_node["pre_tasks"][0]["loop"] == ROLES, "every role's variables are checked before any check runs"
    # node_network needs every node's FQDN, and the listener up before the others connect.
    assert network["strategy"] == "ansible.builtin.linear"
    assert [r["role"] for r in network["roles"]] == ["node_network"]
    assert per_node["hosts"] == network["hosts"]


# The action plugin imports Ansible's controller (plugin loader, collection finder), which insists on being the
# only one to extend the import system: it runs in a fresh interpreter, as in ansible-playbook, and prints what
# its pure functions return.
LOGIN_METHODS_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.unit.nodes.conftest import load_role_file
probe = load_role_file("node_security/action_plugins/tdeploy_ssh_login_methods.py")
ssh_args = "-o 'UserKnownHostsFile=/tmp/known hosts' -o StrictHostKeyChecking=yes"
denied = "Warning: ...\\nroot@node-a: Permission denied (publickey,password,keyboard-interactive).\\n"
print(json.dumps({
    "argv": probe.ssh_argv("node-a; touch /tmp/x", 2222, "trainer", ssh_args, 5),
    "no_user": probe.ssh_argv("node-a", 22, "", "", 5),
    "denied": probe.login_methods(denied),
    "refused": probe.login_methods("ssh: connect to host node-a port 22: Connection refused"),
}))
"""


def test_the_login_methods_probe_gives_ssh_each_value_as_one_argument_and_reads_the_methods() -> None:
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", LOGIN_METHODS_PROBE, str(root)],
        cwd=root,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    argv = out["argv"]
    assert argv[:3] == ["ssh", "-p", "2222"]
    assert argv[3:7] == ["-o", "UserKnownHostsFile=/tmp/known hosts", "-o", "StrictHostKeyChecking=yes"]
    assert argv[-3:] == ["--", "node-a; touch /tmp/x", "true"], "the host is one argument after the options"
    assert ["-l", "trainer"] == argv[argv.index("-l") : argv.index("-l") + 2]
    assert "PubkeyAuthentication=no" in argv and "ControlPath=none" in argv and "ConnectTimeout=5" in argv
    assert "-l" not in out["no_user"]
    assert out["denied"] == ["publickey", "password", "keyboard-interactive"]
    assert out["refused"] == []


def test_the_node_probe_runs_the_job_python_and_reports_why_it_did_not(tmp_path: Path) -> None:
    probe = load_role_file("node_facts/library/tdeploy_node_probe.py")
    script = (PLAYBOOKS / "roles" / "node_facts" / "files" / "python_probe.py").read_text()
    report, error = probe.job_python(sys.executable, script, 30)
    assert error == "" and report["executable"] and report["version"]
    report, error = probe.job_python(str(tmp_path / "no-python"), script, 30)
    assert report == {} and error.startswith("[Errno 2]") and "no-python" in error
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\necho 'Illegal instruction' >&2\nexit 132\n")
    failing.chmod(0o755)
    assert probe.job_python(str(failing), script, 30) == ({}, "Illegal instruction")
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\nexit 0\n")
    silent.chmod(0o755)
    assert probe.job_python(str(silent), script, 30)[1].startswith(f"{silent} printed no probe result")


def test_the_network_probe_lists_the_interfaces_of_its_own_namespace() -> None:
    network = load_role_file("node_network/library/tdeploy_network_probe.py")
    names, error = network.interfaces()
    assert error is None and names == sorted(n for _, n in socket.if_nameindex()) and "lo" in names


def test_loading_the_roles_plugins_leaves_the_interpreter_unpatched_for_later_tests() -> None:
    load_role_file("node_facts/library/tdeploy_node_probe.py")
    assert "ansible.module_utils._internal._patches" in sys.modules, "ansible-core's patches were imported"
    # ansible-core's patches (sys.intern first) make `import torch._dynamo` fail in the same process.
    for container, name in ANSIBLE_PATCH_TARGETS:
        current = getattr(container, name)
        assert not hasattr(current, "unpatched_implementation"), f"{container.__name__}.{name} left patched"
    import torch._dynamo  # noqa: F401, PLC0415 - the import that failed in the suite
