"""Run the node-check playbook with ansible-runner and collect what each host reported.

Results come from the events as they arrive: the `set_stats` data every role publishes per host,
the unreachable and failed hosts, and the controller-side start and end times of the clock task.
`runner.get_fact_cache()` cannot be used: it does not read the cache format of ansible-core 2.19.

Every string of the inventory and the extravars reaches Ansible marked unsafe, so Ansible takes it
literally: ansible-core 2.19 trusts values from `-e` and from inventory files as templates, and a
spec value such as `{{ lookup('pipe', ...) }}` would otherwise run on the controller. An inventory
file (nodes.inventory_path) is never handed to Ansible as it is: `list_inventory` reads it as data
(only the INI and YAML parsers, which template nothing), and the hosts and variables go on as data.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ansible_runner

from tasks.errors import UserError

log = logging.getLogger(__name__)

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
PLAYBOOK = PLAYBOOKS / "check_nodes.yml"
# The task of role node_facts whose controller-side start and end times bracket the node's clock reading.
CLOCK_TASK = "Read the node clock"
ARGSPEC_ACTIONS = {"validate_argument_spec", "ansible.builtin.validate_argument_spec"}
SET_STATS_ACTIONS = {"set_stats", "ansible.builtin.set_stats"}


class RoleArgumentsRejected(UserError):
    """A role's argument spec rejected the variables of the run; no check ran."""

    def __init__(self, errors: list[str], log: str = "") -> None:
        super().__init__(
            "the node-check roles rejected their variables: " + "; ".join(errors),
            "fix the `nodes:` section of the spec (or the variables given) and run again",
        )
        self.errors, self.log = errors, log


class PlaybookDidNotRun(UserError):
    """The playbook ended without reaching any node: no host matched, or Ansible could not start it."""

    def __init__(self, status: str, log: str) -> None:
        tail = log.strip()[-1500:] or "(no output)"
        super().__init__(
            f"the node-check playbook reached no node (status {status}); its output ends with:\n{tail}",
            "check nodes.hosts, or nodes.inventory_path and nodes.inventory_pattern (does any host match?)",
        )
        self.log = log


@dataclass
class PlaybookRun:
    """What one run of the playbook produced, per host."""

    hosts: list[str]
    results: dict[str, dict[str, Any]]
    unreachable: dict[str, str]
    failed: dict[str, str]
    clock_windows: dict[str, tuple[float, float]]
    status: str
    rc: int
    elapsed_s: float
    stdout: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


class _Collector:
    """ansible-runner event handler that keeps only what the report needs (and lets no event reach disk)."""

    def __init__(self) -> None:
        self.hosts: list[str] = []
        self.results: dict[str, dict[str, Any]] = {}
        self.unreachable: dict[str, str] = {}
        self.failures: dict[str, str] = {}
        self.argspec_errors: dict[str, list[str]] = {}
        self.clock_windows: dict[str, tuple[float, float]] = {}
        self.stats: dict[str, Any] = {}

    def __call__(self, event: dict[str, Any]) -> bool:
        kind, data = event.get("event"), event.get("event_data") or {}
        host = data.get("host")
        if host and host not in self.hosts and kind and kind.startswith("runner_on_"):
            self.hosts.append(host)
        res = data.get("res") or {}
        if kind == "runner_on_ok":
            if data.get("task_action") in SET_STATS_ACTIONS:
                for name, sections in (res.get("ansible_stats", {}).get("data", {}).get("tdeploy_nodes") or {}).items():
                    self.results.setdefault(name, {}).update(sections)
            if data.get("task") == CLOCK_TASK and data.get("start") and data.get("end"):
                self.clock_windows[host] = (_epoch(data["start"]), _epoch(data["end"]))
        elif kind == "runner_on_unreachable":
            self.unreachable[host] = _message(res)
        elif kind == "runner_on_failed" and not data.get("ignore_errors"):
            if data.get("task_action") in ARGSPEC_ACTIONS:
                items = [r for r in res.get("results") or [res] if r.get("failed")]
                self.argspec_errors[host] = [str(e) for r in items for e in r.get("argument_errors") or [_message(r)]]
            self.failures[host] = f"{data.get('task', '?')}: {_message(res)}"
        elif kind == "playbook_on_stats":
            self.stats = {k: data.get(k) or {} for k in ("ok", "dark", "failures", "rescued", "processed")}
        return False


def ansible_unsafe(value: Any) -> Any:
    """`value` with every string wrapped as `{"__ansible_unsafe": ...}`: Ansible's JSON form of `!unsafe`."""
    if isinstance(value, str):
        return {"__ansible_unsafe": value}
    if isinstance(value, dict):
        return {key: ansible_unsafe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [ansible_unsafe(item) for item in value]
    return value


def _epoch(value: str | dt.datetime) -> float:
    moment = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def _message(res: dict[str, Any]) -> str:
    text = str(res.get("msg") or res.get("stderr") or res.get("reason") or "failed").strip()
    return " ".join(text.split())[:1000]


def ansible_playbook_path() -> str:
    """The directory holding ansible-playbook: the one next to this Python first (the venv), then PATH."""
    here = Path(sys.executable).parent
    found = shutil.which("ansible-playbook", path=f"{here}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise UserError(
            "ansible-playbook is not installed next to this Python nor on PATH",
            "install the project's dependencies (`bash .ci/setup`), which include ansible-core",
        )
    return str(Path(found).parent)


def close_control_masters(control_dir: Path) -> None:
    """Stop the SSH ControlPersist masters this run started, through their sockets (they would linger)."""
    for socket_path in control_dir.iterdir() if control_dir.is_dir() else []:
        subprocess.run(
            ["ssh", "-o", f"ControlPath={socket_path}", "-O", "exit", "tdeploy-node"],
            capture_output=True,
            timeout=10,
            check=False,
        )


def ansible_environment(
    work: Path, *, connect_timeout_s: int, task_timeout_s: int, control_dir: Path
) -> dict[str, str]:
    """The environment of one run: playbooks/ansible.cfg (pipelining, ControlPersist, ...), the run's limits, and
    its own folders for the SSH control sockets and Ansible's local temporary files."""
    return {
        "ANSIBLE_CONFIG": str(PLAYBOOKS / "ansible.cfg"),
        "ANSIBLE_TIMEOUT": str(connect_timeout_s),
        "ANSIBLE_TASK_TIMEOUT": str(task_timeout_s),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control_dir),
        "ANSIBLE_LOCAL_TEMP": str(work / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "PATH": f"{ansible_playbook_path()}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def list_inventory(path: Path, timeout_s: int = 120) -> dict[str, Any]:
    """`ansible-inventory --list` over one static inventory file: its groups and each host's merged variables, as
    they are written (listing templates nothing). Only the INI and YAML parsers may read it: no script, no plugin.
    """
    with tempfile.TemporaryDirectory(prefix="tdeploy-inventory-") as work:
        env = {
            **os.environ,
            "ANSIBLE_CONFIG": str(PLAYBOOKS / "ansible.cfg"),
            "ANSIBLE_INVENTORY_ENABLED": "ini,yaml",
            "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
            "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
            "ANSIBLE_LOCAL_TEMP": work,
            "ANSIBLE_NOCOLOR": "1",
        }
        command = [str(Path(ansible_playbook_path()) / "ansible-inventory"), "-i", str(path), "--list"]
        try:
            done = subprocess.run(  # stdin: Ansible refuses a non-blocking one (CI, a Prefect worker)
                command, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, cwd=work,
                timeout=timeout_s, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as err:
            raise UserError(
                f"nodes.inventory_path={path}: ansible-inventory did not list it within {timeout_s} s",
                "give a static INI or YAML inventory of the nodes, or list them under nodes.hosts",
            ) from err
    if done.returncode != 0:
        tail = " ".join(done.stderr.split())[-1500:] or "(no output)"
        raise UserError(
            f"nodes.inventory_path={path}: Ansible cannot read it as an INI or YAML inventory: {tail}",
            "give a static INI or YAML inventory of the nodes, or list them under nodes.hosts",
        )
    listed = json.loads(done.stdout)
    if not isinstance(listed, dict):
        raise UserError(f"nodes.inventory_path={path}: ansible-inventory listed no groups", "check the inventory")
    return listed


def run_playbook(
    inventory: dict[str, Any],
    extravars: dict[str, Any],
    *,
    forks: int,
    connect_timeout_s: int,
    task_timeout_s: int,
    run_timeout_s: int | None,
    host_order: list[str] | None = None,
) -> PlaybookRun:
    """Run playbooks/check_nodes.yml once; raises RoleArgumentsRejected when a role's argument spec says no."""
    collector = _Collector()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tdeploy-nodes-") as work:
        control_dir = Path(work) / "cp"
        control_dir.mkdir()
        env = ansible_environment(
            Path(work), connect_timeout_s=connect_timeout_s, task_timeout_s=task_timeout_s, control_dir=control_dir
        )
        try:
            runner = ansible_runner.run(
                private_data_dir=work,
                ident="check-nodes",
                project_dir=str(PLAYBOOKS),
                playbook=str(PLAYBOOK),
                inventory=ansible_unsafe(inventory),
                extravars=ansible_unsafe(extravars),
                envvars=env,
                forks=forks,
                timeout=run_timeout_s,
                quiet=True,
                event_handler=collector,
                # Without a callback ansible-runner installs SIGINT/SIGTERM handlers that only set a flag, for
                # good: the process that ran the node checks (`tdeploy run`) would no longer stop on Ctrl-C.
                cancel_callback=lambda: False,
            )
        finally:
            close_control_masters(control_dir)
        stdout_file = Path(work) / "artifacts" / "check-nodes" / "stdout"
        stdout = stdout_file.read_text(errors="replace") if stdout_file.exists() else ""
    if collector.argspec_errors:
        errors = sorted({e for errs in collector.argspec_errors.values() for e in errs})
        raise RoleArgumentsRejected(errors, stdout)
    if not collector.hosts:
        raise PlaybookDidNotRun(runner.status, stdout)
    failed_hosts = set(collector.stats.get("failures", {})) if collector.stats else set(collector.failures)
    hosts = list(host_order or [])
    hosts += [h for h in collector.hosts if h not in hosts]
    log.info("node-check playbook %s (rc %s) in %.1f s", runner.status, runner.rc, time.monotonic() - started)
    return PlaybookRun(
        hosts=hosts,
        results=collector.results,
        unreachable=collector.unreachable,
        failed={h: collector.failures.get(h, "failed") for h in failed_hosts if h not in collector.unreachable},
        clock_windows=collector.clock_windows,
        status=runner.status,
        rc=runner.rc,
        elapsed_s=time.monotonic() - started,
        stdout=stdout,
        stats=collector.stats,
    )
