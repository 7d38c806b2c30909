"""A host of the cluster: the name the other hosts know it by and how the controller reaches it.

Shared by the node checks (`nodes.hosts`) and the launchers that start agents on hosts themselves
(`cluster.ssh.hosts`), so that both see one inventory.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from training.config import StrictModel

HOST_NAME = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,252})$"
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}")


def _user(value: str) -> str:
    if not _USER.fullmatch(value):
        raise ValueError(f"{value!r} is not a user name; use letters, digits and _ . @ - (e.g. trainer)")
    return value


UserName = Annotated[str, AfterValidator(_user)]
"""A user name that reaches SSH and Ansible."""


def is_host(value: str) -> bool:
    """An IP address, or a host name of letters, digits and . _ - starting with a letter or digit."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return re.fullmatch(HOST_NAME, value) is not None
    return True


class NodeHost(StrictModel):
    """One node: the name the other nodes know it by, and where the controller reaches it."""

    name: str = Field(
        pattern=HOST_NAME,
        description="Host name of the node: the inventory name, and the name every other node must resolve.",
    )
    address: str | None = Field(
        default=None, min_length=1, description="Address or name the controller connects to; None = name."
    )
    port: int = Field(default=22, ge=1, le=65535, description="SSH port of the node.")
    connection: Literal["ssh", "local"] = Field(
        default="ssh", description="ssh: over SSH; local: this machine, without SSH (the local scheduler)."
    )

    @field_validator("address")
    @classmethod
    def _address_is_a_host(cls, value: str | None) -> str | None:
        if value is not None and not is_host(value):
            raise ValueError(f"{value!r} is not a host name or an IP address; e.g. node-1.example.com or 10.0.0.7")
        return value
