"""The torchrun agent of a local job: `python -m torch.distributed.run`, set to die with the wrapper that started it."""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
from pathlib import Path

from tasks.launch.spares import SPARE_WAIT_ENV, stand_down_when_unneeded, wait_until_needed
from training.preemption import run_torchrun
from training.process import die_with_parent, exit_now, start_time

AGENT_RECORD_ENV = "TDEPLOY_AGENT_RECORD"
"""Where the agent writes its host, pid and start time (a job's processes on another host are found by them)."""


def write_record() -> None:
    """Write this agent's host, pid and start time where AGENT_RECORD_ENV says (complete or absent)."""
    path = os.environ.pop(AGENT_RECORD_ENV, None)  # not the workers' business
    if not path:
        return
    record = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": start_time(os.getpid())}
    partial = Path(f"{path}.partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)


def main() -> int:
    """Run torchrun with this process's arguments once the parent-death signal is in place; its exit code
    (PREEMPTED_EXIT_CODE when the workers checkpointed and stopped on a preemption signal)."""
    die_with_parent()  # the wrapper (or, over SSH, sshd's session) is its parent: its exit fires this
    write_record()
    spare = os.environ.pop(SPARE_WAIT_ENV, None)
    if spare:
        importlib.import_module("torch.distributed.run")  # seconds of imports, paid before a node is lost, not after
        if not wait_until_needed(spare):
            return 0  # a hot spare whose job ended before its ranks met: nothing to stand by for
        stand_down_when_unneeded(spare)
    return run_torchrun(sys.argv[1:])


if __name__ == "__main__":
    exit_now(main())
