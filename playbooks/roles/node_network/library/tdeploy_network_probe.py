#!/usr/bin/python
"""Ansible module: what the network checks need from a node, in one module run.

Resolves names the way the node's own libc does (/etc/hosts, DNS, nsswitch), lists the node's network
interfaces, and on the rendezvous host starts the rendezvous listener. Each separate module run would cost
a Python start on the node and a round trip, and the listener start would be one more step every other
node waits for before it connects.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: tdeploy_network_probe
short_description: Resolve host names, list the interfaces and start the rendezvous listener on a node
description:
  - Resolves every name with getaddrinfo, in parallel, and reports the addresses or the error per name.
  - Lists the node's network interfaces with socket.if_nameindex, which asks the kernel for those of the
    node's own network namespace (/sys/class/net lists those of whoever mounted /sys).
  - With listen_port, runs the rendezvous probe script's C(start) under this module's Python: it binds the
    port and leaves a detached listener behind that the script's C(stop) ends.
  - Never fails on a name that does not resolve, missing interfaces or a port in use; the result says so.
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
  list_interfaces:
    description: Whether to list the node's network interfaces.
    type: bool
    default: false
  listen_port:
    description: Rendezvous port to start the listener on; unset = no listener.
    type: int
  listen_timeout_s:
    description: Seconds the listener lives at most when nobody stops it.
    type: int
    default: 600
  rdzv_probe:
    description: Source of the rendezvous probe script (files/rdzv_probe.py); required with listen_port.
    type: str
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
interfaces:
  description: Sorted interface names; null when not asked for or when they could not be listed.
  returned: always
  type: list
interface_error:
  description: Why the interfaces could not be listed; null otherwise.
  returned: always
  type: str
listener:
  description: What the probe's C(start) printed (listening, pid or error); null without listen_port.
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


def interfaces():
    """(sorted interface names, None), or (None, why they could not be listed)."""
    try:
        return sorted(name for _, name in socket.if_nameindex()), None
    except OSError as err:
        return None, (err.strerror or str(err))[:300]


def start_listener(script, port, deadline_s, timeout_s=30):
    """What `rdzv_probe.py start PORT DEADLINE_S` printed, run under this Python with the script on stdin."""
    argv = [sys.executable, "-", "start", str(port), str(deadline_s)]
    try:
        proc = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"listening": False, "error": f"the listener did not start within {timeout_s}s"}
    except OSError as err:
        return {"listening": False, "error": f"the listener did not start: {err}"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        why = proc.stderr.strip() or f"exit code {proc.returncode}"
        return {"listening": False, "error": f"the listener did not start: {why[-300:]}"}


def main():
    """Entry point."""
    module = AnsibleModule(
        argument_spec={
            "names": {"type": "list", "elements": "str", "required": True},
            "timeout_s": {"type": "int", "default": 10},
            "list_interfaces": {"type": "bool", "default": False},
            "listen_port": {"type": "int"},
            "listen_timeout_s": {"type": "int", "default": 600},
            "rdzv_probe": {"type": "str"},
        },
        required_by={"listen_port": "rdzv_probe"},
        supports_check_mode=False,
    )
    params = module.params
    listener = None
    if params["listen_port"] is not None:
        # First, so that the other nodes' connects, which come next, find the port open.
        listener = start_listener(params["rdzv_probe"], params["listen_port"], params["listen_timeout_s"])
    addresses, errors = resolve_all(list(dict.fromkeys(params["names"])), params["timeout_s"])
    names, interface_error = interfaces() if params["list_interfaces"] else (None, None)
    module.exit_json(
        changed=False,
        addresses=addresses,
        errors=errors,
        interfaces=names,
        interface_error=interface_error,
        listener=listener,
    )


if __name__ == "__main__":
    main()
