"""The torchrun agent of a local job: `python -m torch.distributed.run`, set to die with the wrapper that started it."""

from __future__ import annotations

import json
import os
import runpy
import socket
from pathlib import Path

from training.process import die_with_parent, exit_now, start_time

AGENT_RECORD_ENV = "TDEPLOY_AGENT_RECORD"
"""Where the agent writes its host, pid and start time (a job's processes on another host are found by them)."""


def _record() -> None:
    """Write this agent's host, pid and start time where AGENT_RECORD_ENV says (complete or absent)."""
    path = os.environ.pop(AGENT_RECORD_ENV, None)  # not the workers' business
    if not path:
        return
    record = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": start_time(os.getpid())}
    partial = Path(f"{path}.partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)


def main() -> int:
    """Run torchrun with this process's arguments once the parent-death signal is in place; its exit code."""
    die_with_parent()  # the wrapper (or, over SSH, sshd's session) is its parent: its exit fires this
    _record()
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SystemExit as done:  # torchrun's own exit (a failed job: its code)
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    exit_now(main())
