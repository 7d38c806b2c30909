"""`.ci/setup` waits for the package manager's lock (held by unattended upgrades on a fresh VM) and says so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import stop_process

REPO = Path(__file__).resolve().parents[2]
LOCK = Path("/var/lib/dpkg/lock-frontend")
HOLD_S = 3

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not LOCK.exists() or shutil.which("apt-get") is None,
    reason="needs root on a Debian/Ubuntu machine (as CI has)",
)

_HOLDER = f"""
import fcntl, sys, time
with open({str(LOCK)!r}, "w") as lock:
    fcntl.lockf(lock, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep({HOLD_S})
"""


def _hold_the_lock() -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_apt_get_waits_for_a_held_package_lock_and_names_its_holder() -> None:
    holder = _hold_the_lock()
    try:
        done = subprocess.run(
            ["bash", str(REPO / ".ci" / "apt-get"), "check"], capture_output=True, text=True, timeout=120
        )
    finally:
        stop_process(holder)
    assert done.returncode == 0, done.stderr  # plain apt-get fails at once: "Could not get lock"
    assert f"held by process {holder.pid} (python" in done.stderr
    assert "setup: waiting up to 900 s for /var/lib/dpkg/lock-frontend" in done.stderr


def test_the_lock_notice_is_printed_where_setup_shows_it_and_runs_nothing() -> None:
    holder = _hold_the_lock()
    try:
        done = subprocess.run(
            ["bash", str(REPO / ".ci" / "apt-get"), "--lock-notice"], capture_output=True, text=True, timeout=30
        )
        still_held = holder.poll() is None
    finally:
        stop_process(holder)
    assert done.returncode == 0
    assert still_held  # the notice did not wait for the lock
    assert done.stdout.startswith("setup: waiting up to 900 s for /var/lib/dpkg/lock-frontend, held by process")


def test_setup_installs_through_the_waiting_apt_get() -> None:
    setup = (REPO / ".ci" / "setup").read_text()
    calls = [line for line in setup.splitlines() if "apt-get update" in line or "apt-get install" in line]
    assert calls and all(".ci/apt-get" in line for line in calls), calls
