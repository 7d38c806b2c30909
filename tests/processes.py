"""Processes the tests start: each in its own session, and the whole group stopped however the test ends.

Every group started here (and every server process a fixture hands to `track`) is recorded until it is
stopped; `stop_all` stops what is left. tests/conftest.py calls it at the end of the test session, and it
also runs at interpreter exit and on SIGTERM, so a test or fixture that times out or raises cannot leave a
server behind. Processes are only ever stopped by the PID or process group recorded here, never by name.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_groups: dict[int, subprocess.Popen] = {}  # process groups started by start_group, by leader PID
_tracked: dict[int, subprocess.Popen] = {}  # single processes started elsewhere (a library's server)
_daemons: dict[int, str] = {}  # daemons that detached themselves, by the PID they wrote


def start_group(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **kwargs)` as the leader of a new session, recorded until `stop_group`."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    with _lock:
        _groups[proc.pid] = proc
    return proc


def track(proc: subprocess.Popen) -> subprocess.Popen:
    """Record a process started by other code (not a group leader) so that `stop_all` stops it by PID."""
    with _lock:
        _tracked[proc.pid] = proc
    return proc


def track_daemon(pid: int, what: str) -> None:
    """Record a daemon that detached itself (it wrote `pid` to its pid file) so that `stop_all` stops it."""
    with _lock:
        _daemons[pid] = what


def forget_daemon(pid: int) -> None:
    """The daemon `pid` was stopped by its owner."""
    with _lock:
        _daemons.pop(pid, None)


def live_groups() -> list[int]:
    """Leader PIDs of the groups started here and not yet stopped."""
    with _lock:
        return list(_groups)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed user (a daemon dropping root): the group is still there
        return True
    return True


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the process group `pgid`; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group `proc` leads, then SIGKILL whatever is left of it after `grace_s`."""
    try:
        _signal_group(proc.pid, signal.SIGCONT)  # a frozen (SIGSTOPped) member cannot act on SIGTERM
        if not _signal_group(proc.pid, signal.SIGTERM):
            proc.poll()
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_exists(proc.pid):  # the leader and its whole group
                return
            time.sleep(0.05)
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        with _lock:
            _groups.pop(proc.pid, None)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM one process, SIGKILL it after `grace_s`, and reap it."""
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
    finally:
        with _lock:
            _tracked.pop(proc.pid, None)


def _stop_daemon(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    forget_daemon(pid)


def stop_all(grace_s: float = 5.0) -> list[int]:
    """Stop every group, tracked process and daemon still recorded; the PIDs that were still recorded."""
    with _lock:
        groups, tracked, daemons = list(_groups.values()), list(_tracked.values()), list(_daemons)
    for proc in groups:
        stop_group(proc, grace_s=grace_s)
    for proc in tracked:
        stop_process(proc, grace_s=grace_s)
    for pid in daemons:
        _stop_daemon(pid)
    return [p.pid for p in groups] + [p.pid for p in tracked] + daemons


def run_group(cmd: Sequence[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a new session; on timeout or any exception
    (pytest's own timeout included) the whole process group is stopped, not just its leader."""
    proc = start_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        stop_group(proc)
        raise
    stop_group(proc, grace_s=0.5)  # the leader exited: stop anything it left behind in its group
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _stop_all_then_terminate(signum: int, frame: object) -> None:
    stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_safety_net() -> None:
    """Stop what is left at interpreter exit and on SIGTERM (when nobody else handles SIGTERM)."""
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_all_then_terminate)


def daemon_pid(pid_file: Path, timeout_s: float = 20.0, log: Path | None = None) -> int:
    """The pid a daemon wrote to `pid_file` (waiting for it); TimeoutError with the daemon's log tail if never."""
    deadline = time.monotonic() + timeout_s
    while not pid_file.exists() or not pid_file.read_text().strip():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else "(no log)"
            raise TimeoutError(f"no pid file {pid_file} within {timeout_s} s: {tail}")
        time.sleep(0.1)
    return int(pid_file.read_text().split()[0])
