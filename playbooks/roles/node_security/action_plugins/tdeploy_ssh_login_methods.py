"""Action plugin: ask a node's sshd, from the controller, which login methods it offers without a key.

It runs on the controller in the worker that handles the node, so it needs no module run (a local Python
start per node) and no shell: the ssh client gets its arguments as a list.
"""

from __future__ import annotations

import re
import shlex
import subprocess

from ansible.plugins.action import ActionBase

# ssh ends with "Permission denied (publickey,password)." listing what the server still allows.
DENIED = re.compile(r"Permission denied \(([^)]*)\)")

ARGUMENT_SPEC = {
    "host": {"type": "str", "required": True},
    "port": {"type": "int", "default": 22},
    "user": {"type": "str", "default": ""},
    "ssh_args": {"type": "str", "default": ""},
    "connect_timeout_s": {"type": "int", "default": 10},
}


def ssh_argv(host: str, port: int, user: str, ssh_args: str, connect_timeout_s: int) -> list[str]:
    """The ssh client's command line: no key, no agent, no control master, password methods preferred."""
    return [
        "ssh",
        "-p",
        str(port),
        *shlex.split(ssh_args),
        "-o",
        "BatchMode=yes",
        "-o",
        "ControlPath=none",
        "-o",
        "PubkeyAuthentication=no",
        "-o",
        "GSSAPIAuthentication=no",
        "-o",
        "PreferredAuthentications=password,keyboard-interactive",
        "-o",
        f"ConnectTimeout={connect_timeout_s}",
        *(["-l", user] if user else []),
        "--",
        host,
        "true",
    ]


def login_methods(stderr: str) -> list[str]:
    """The methods sshd listed when it refused the login, e.g. ["publickey", "password"]."""
    found = DENIED.findall(stderr)
    return [m for m in (found[0] if found else "").split(",") if m]


class ActionModule(ActionBase):
    """Run the ssh client against the node and report its exit code, the methods offered and its last error.

    The exit code is `probe_rc`, not `rc`: ssh always fails here (no key is offered), which is the answer.
    """

    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        """Probe the node named by the task's arguments."""
        result = super().run(tmp, task_vars)
        del tmp
        _, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        argv = ssh_argv(args["host"], args["port"], args["user"], args["ssh_args"], args["connect_timeout_s"])
        result.update(changed=False, cmd=argv, probe_rc=None, methods=[])
        # ConnectTimeout bounds the connect and the key exchange; the rest is one refused authentication.
        timeout_s = 2 * args["connect_timeout_s"] + 10
        try:
            proc = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            result["probe_error"] = f"ssh did not finish within {timeout_s}s"
            return result
        except OSError as err:
            result["probe_error"] = f"cannot run ssh: {err}"
            return result
        result.update(
            probe_rc=proc.returncode,
            methods=login_methods(proc.stderr),
            probe_error="".join(proc.stderr.strip().splitlines()[-1:]),
        )
        return result
