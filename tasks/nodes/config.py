"""The `nodes:` section of the spec: which nodes to check, how to reach them, and what they need."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, field_validator, model_validator

from tasks.hosts import NodeHost, UserName, is_host
from training.config import Problem, StrictModel, raise_problems

# Values reach Ansible (inventory, extravars, interpreter command lines): no template syntax, no shell syntax.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_TEMPLATE = re.compile(r"\{\{|\{%|\{#")
_PROGRAM = re.compile(r"[A-Za-z0-9_./+@-]+")


def _plain_text(value: str) -> str:
    """Refuse control characters and Jinja markers: a spec value is data, never a template Ansible runs."""
    if _CONTROL.search(value):
        raise ValueError(f"{value!r} contains a control character (newline, tab, NUL...); remove it")
    if _TEMPLATE.search(value):
        raise ValueError(
            f"{value!r} contains template syntax ({{{{, {{% or {{#), which Ansible would run on the controller; "
            "give the literal value"
        )
    return value


def _program(value: str) -> str:
    """A program path or name: letters, digits and _ . / + @ - only (no spaces, quotes or shell syntax)."""
    _plain_text(value)
    if not _PROGRAM.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a plain program path; use letters, digits and _ . / + @ - only, "
            "e.g. /opt/venv/bin/python (wrap anything more in a script on the nodes)"
        )
    return value


PlainText = Annotated[str, AfterValidator(_plain_text)]
"""Text that reaches Ansible as a value: one line, no template syntax."""
Program = Annotated[str, AfterValidator(_program)]
"""A program path that reaches a command line on the nodes."""


class StorageMount(StrictModel):
    """Storage the job needs on every node."""

    path: PlainText = Field(min_length=1, description="Absolute path; must exist and be writable by nodes.ssh_user.")
    min_free_gb: float | None = Field(
        default=None,
        gt=0,
        le=1e9,
        allow_inf_nan=False,
        description="Free space the path needs, in GB (10^9 bytes); None = no minimum.",
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must be an absolute path (the same on every node); got {value!r}")
        return value


class NodesConfig(StrictModel):
    """Node environment checks: consistent, reachable, ready nodes before any job starts."""

    hosts: list[NodeHost] | None = Field(
        default=None,
        min_length=1,
        description="Nodes to check, first = rendezvous host; None = localhost over the local connection "
        "(with cluster.scheduler local) or the hosts of `inventory_path`.",
    )
    inventory_path: PlainText | None = Field(
        default=None,
        min_length=1,
        description="An existing static INI or YAML Ansible inventory instead of `hosts`, read as data (no "
        "script, plugin or template syntax; among Ansible's variables only ansible_host, ansible_port, ansible_user, "
        "ansible_python_interpreter and ansible_connection=ssh); its hosts matching `inventory_pattern` are "
        "checked, in inventory order (first = rendezvous host).",
    )
    inventory_pattern: PlainText = Field(
        default="all", min_length=1, description="Ansible host pattern selecting the nodes in `inventory_path`."
    )
    ssh_user: UserName | None = Field(
        default=None, min_length=1, description="SSH user (the user the job runs as); None = the SSH default."
    )
    ssh_key_path: PlainText | None = Field(
        default=None,
        min_length=1,
        description="Path of the SSH private key on the controller (a path, never the key); None = agent/defaults.",
    )
    known_hosts_path: PlainText | None = Field(
        default=None,
        min_length=1,
        description="known_hosts file with the nodes' host keys; None = the SSH default (~/.ssh/known_hosts).",
    )
    python: Program | None = Field(
        default=None,
        min_length=1,
        description="Python the job runs with on the nodes, compared across nodes with its torch build; "
        "None = python3 (local connection: the Python running tdeploy).",
    )
    ansible_python: Program | None = Field(
        default=None,
        min_length=1,
        description="Python that Ansible runs its checks with on the nodes; None = discovered on each node.",
    )
    storage: list[StorageMount] = Field(default_factory=list, description="Storage the job needs on every node.")
    rdzv_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Rendezvous port to test from every node to the first; None = the job's port "
        "(cluster.slurm.rdzv_port under Slurm, else cluster.rdzv_port), else 29500 (torchrun's default) with "
        "several hosts, else no port check.",
    )
    rdzv_address: str | None = Field(
        default=None,
        min_length=1,
        description="Name or address the nodes connect to for the rendezvous; None = the first host's name.",
    )
    max_clock_skew_s: float = Field(
        default=1.0, gt=0, le=3600, allow_inf_nan=False, description="Largest clock difference allowed between nodes."
    )
    connect_timeout_s: int = Field(
        default=10, ge=1, le=3600, description="Seconds to reach a node over SSH (connect, banner, key exchange)."
    )
    task_timeout_s: int = Field(default=120, ge=1, le=86400, description="Seconds one check may run on one node.")
    rdzv_connect_timeout_s: int = Field(
        default=5, ge=1, le=3600, description="Seconds a node waits for its TCP connection to the rendezvous port."
    )
    run_timeout_s: int | None = Field(
        default=1800,
        ge=1,
        le=7 * 86400,
        description="Seconds the whole check may take before it is stopped; None = no limit.",
    )
    forks: int = Field(default=50, ge=1, le=1000, description="Nodes checked in parallel.")
    check_password_auth: bool = Field(
        default=True, description="Ask every node's sshd whether it still offers password login."
    )

    @field_validator("ssh_key_path", mode="before")
    @classmethod
    def _key_is_a_path(cls, value: object) -> object:
        if isinstance(value, str) and ("PRIVATE KEY" in value or "\n" in value):
            raise ValueError("holds a key, not a path; put the key in a file (mode 0600) and give its path")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> NodesConfig:
        problems: list[Problem] = []
        if self.hosts is not None and self.inventory_path is not None:
            problems.append((("inventory_path",), self.inventory_path, "set either hosts or inventory_path, not both"))
        names = [h.name for h in self.hosts or []]
        for name in sorted({n for n in names if names.count(n) > 1}):
            problems.append((("hosts",), name, f"host {name} is listed twice; list every node once"))
        if self.rdzv_address is not None and not is_host(self.rdzv_address):
            problems.append((("rdzv_address",), self.rdzv_address, "must be a host name or an IP address"))
        raise_problems("NodesConfig", problems)
        return self
