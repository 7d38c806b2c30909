"""tests/processes.py stops whole process groups: on timeout, on exception, at session end and on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import processes
from tests.conftest import REPO, process_running

# A leader that starts a grandchild which ignores SIGTERM (as a Prefect worker started in the background
# does), writes the grandchild's PID, and waits.
FAMILY = textwrap.dedent(
    """\
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    open(sys.argv[1], "w").write(str(child.pid))
    time.sleep(300)
    """
)


def _wait_for_pid(path: Path) -> int:
    for _ in range(600):
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} was never written")


def _gone(pid: int) -> bool:
    for _ in range(200):
        if not process_running(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry of this test's own: the session's servers (registry, sshd hosts...) are in the real one, and
    stop_all here must not stop them."""
    monkeypatch.setattr(processes, "_groups", {})
    monkeypatch.setattr(processes, "_tracked", {})
    monkeypatch.setattr(processes, "_daemons", {})


def test_run_group_stops_the_whole_group_on_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run_group([sys.executable, "-c", FAMILY, str(pid_file)], timeout=3)
    grandchild = int(pid_file.read_text())
    assert _gone(grandchild), "the grandchild outlived run_group's timeout"
    assert processes.live_groups() == []


def test_run_group_stops_the_whole_group_when_the_caller_raises(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)  # what pytest-timeout's signal method does
    try:
        signal.setitimer(signal.ITIMER_REAL, 3)
        with pytest.raises(Interrupted):
            processes.run_group([sys.executable, "-c", FAMILY, str(pid_file)], timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _gone(int(pid_file.read_text())), "the grandchild outlived the exception"
    assert processes.live_groups() == []


def test_stop_all_stops_groups_nobody_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    leader = processes.start_group([sys.executable, "-c", FAMILY, str(pid_file)])
    grandchild = _wait_for_pid(pid_file)
    assert leader.pid in processes.live_groups()
    stopped = processes.stop_all(grace_s=1)
    assert leader.pid in stopped
    assert leader.poll() is not None
    assert _gone(grandchild)
    assert processes.live_groups() == []


def test_sigterm_to_a_session_with_the_safety_net_stops_its_groups(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    session = textwrap.dedent(
        f"""\
        import sys, time
        from tests import processes
        processes.install_safety_net()
        processes.start_group([sys.executable, "-c", {FAMILY!r}, {str(pid_file)!r}])
        time.sleep(300)
        """
    )
    outer = subprocess.Popen([sys.executable, "-c", session], cwd=REPO, start_new_session=True)
    try:
        grandchild = _wait_for_pid(pid_file)
        outer.send_signal(signal.SIGTERM)
        assert outer.wait(timeout=60) == -signal.SIGTERM
        assert _gone(grandchild), "the session's group outlived its SIGTERM"
    finally:
        processes.stop_group(outer, grace_s=1)
