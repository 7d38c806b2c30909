#!/usr/bin/python
"""Ansible module: resolve names the way the node's own libc does (/etc/hosts, DNS, nsswitch)."""

from __future__ import annotations

import queue
import socket
import threading
import time

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: tdeploy_resolve
short_description: Resolve host names on the node
description:
  - Resolves every name with getaddrinfo, in parallel, and reports the addresses or the error per name.
  - Never fails on a name that does not resolve; the result says so.
options:
  names:
    description: Host names to resolve.
    type: list
    elements: str
    required: true
  timeout_s:
    description: Seconds all lookups together may take; names still pending then count as failed.
    type: int
    default: 10
"""

RETURN = r"""
addresses:
  description: Name to sorted list of addresses; an empty list when the name does not resolve.
  returned: always
  type: dict
errors:
  description: Name to the resolver's error, for the names that did not resolve.
  returned: always
  type: dict
"""


def lookup(name):
    """Sorted unique addresses of name."""
    infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    return sorted({info[4][0] for info in infos})


def resolve_all(names, timeout_s, workers=32):
    """(addresses, errors) of every name; daemon threads, so a hung lookup cannot hold the module open."""
    todo, answers = queue.Queue(), queue.Queue()
    for name in names:
        todo.put(name)

    def work():
        while True:
            try:
                name = todo.get_nowait()
            except queue.Empty:
                return
            try:
                answers.put((name, lookup(name), None))
            except (OSError, UnicodeError) as err:
                answers.put((name, [], getattr(err, "strerror", None) or str(err)))

    for _ in range(min(workers, len(names))):
        threading.Thread(target=work, daemon=True).start()
    addresses, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    while len(addresses) < len(names):
        try:
            name, found, error = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        addresses[name] = found
        if error:
            errors[name] = error
    for name in names:
        if name not in addresses:
            addresses[name] = []
            errors[name] = f"no answer within {timeout_s}s"
    return addresses, errors


def main():
    """Entry point."""
    module = AnsibleModule(
        argument_spec={
            "names": {"type": "list", "elements": "str", "required": True},
            "timeout_s": {"type": "int", "default": 10},
        },
        supports_check_mode=True,
    )
    addresses, errors = resolve_all(list(dict.fromkeys(module.params["names"])), module.params["timeout_s"])
    module.exit_json(changed=False, addresses=addresses, errors=errors)


if __name__ == "__main__":
    main()
