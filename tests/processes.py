"""Processes the tests start: each in its own session, and the whole group stopped however the test ends."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group `proc` leads, then SIGKILL whatever is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; its group may not be
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return


def run_group(cmd: Sequence[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a new session; on timeout or any exception
    (pytest's own timeout included) the whole process group is stopped, not just its leader."""
    proc = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        stop_group(proc)
        raise
    stop_group(proc, grace_s=0.5)  # the leader exited: stop anything it left behind in its group
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
