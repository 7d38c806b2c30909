"""Processes on this machine: who a pid is (its start time), whether it still runs, and dying with a parent.

A pid alone is not an identity: pids are reused. A pid together with its start
time (field 22 of /proc/PID/stat, in clock ticks since boot) is, on one boot of
one machine and within one pid namespace; `machine()` names those two.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# The parent this process was started by, read as early as the module is imported: if the parent
# dies before die_with_parent() runs, getppid() no longer matches it.
_PARENT_AT_IMPORT = os.getppid()


def _parent_is_the_forker() -> None:
    """A forked child (a worker forked from its agent: training/worker_start.py) was started by its forker."""
    global _PARENT_AT_IMPORT  # noqa: PLW0603 - the one module-level fact a fork changes
    _PARENT_AT_IMPORT = os.getppid()


os.register_at_fork(after_in_child=_parent_is_the_forker)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3), or None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), or None if it is gone or a zombie."""
    fields = _stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else fields[19]


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger: state T or t); False where /proc does not say."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("T", "t")


def started_unix_s(pid: int | None = None) -> float | None:
    """When a process (default: this one) started, in unix seconds (to the kernel's clock tick): its start after
    boot (field 22 of /proc/PID/stat) against the time since boot now; None where /proc does not say."""
    ticks = start_time(os.getpid() if pid is None else pid)
    if ticks is None or not hasattr(time, "CLOCK_BOOTTIME"):
        return None
    since_boot, now = time.clock_gettime(time.CLOCK_BOOTTIME), time.time()
    return now - (since_boot - int(ticks) / os.sysconf("SC_CLK_TCK"))


def alive(pid: int, started: str | None) -> bool:
    """The process runs and, when `started` is given, is the one that started then (not a reused pid)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own child
    now = start_time(pid)
    return now is not None and (started is None or now == started)


@dataclass(frozen=True)
class Machine:
    """Where pids mean something: this boot of this host, in this pid namespace."""

    host: str
    boot_id: str | None
    pid_namespace: str | None

    def same_pid_space(self, other: Machine) -> bool:
        """A pid recorded on `other` can be looked up here (known boot and namespace, both equal)."""
        return (
            self.boot_id is not None
            and self.pid_namespace is not None
            and (self.boot_id, self.pid_namespace) == (other.boot_id, other.pid_namespace)
        )


def machine() -> Machine:
    """This machine's host name, boot id and pid namespace (None where the system does not tell)."""
    boot_id = pid_namespace = None
    with contextlib.suppress(OSError):
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        pid_namespace = os.readlink("/proc/self/ns/pid")
    return Machine(socket.gethostname(), boot_id, pid_namespace)


def parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """prctl(PR_SET_PDEATHSIG) alone: `sig` to this process when its parent exits (False: not Linux). For a child
    between fork and exec (subprocess's preexec_fn: a binary that cannot ask itself, the torchft lighthouse); a
    Python process asks with die_with_parent, which also catches a parent gone before the request."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    return True


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` to this process when its parent (thread) exits; exit now if it already has.

    Returns False where the system has no such request (not Linux). Only for processes whose
    parent is their supervisor and lives as long as they should: torchrun workers and agents.
    """
    if not parent_death_signal(sig):
        return False
    if os.getppid() != _PARENT_AT_IMPORT:  # the parent died before the request was in place
        log.error("parent process %d exited before this process (%d) started: exiting", _PARENT_AT_IMPORT, os.getpid())
        os.kill(os.getpid(), sig)
    return True


def exit_now(code: int) -> None:
    """End the process with `code` once its output is flushed, skipping the interpreter's teardown.

    A process that imported torch spends seconds tearing its modules down after its work is done and
    written; a job pays that in every worker and in its agent before its exit is seen. Call it only where
    everything the process owes is on disk: the trainer's files are closed and its process group destroyed.
    """
    flush_output()
    os._exit(code)


def flush_output() -> None:
    """Flush the logging handlers and the standard streams: what a process owes its logs before it ends."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
