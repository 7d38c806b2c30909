"""The local launcher's reads of other processes (through psutil)."""

from __future__ import annotations

import os
import subprocess
import sys

from tasks.launch.local import parent_pid


def test_parent_pid_names_the_parent_and_none_once_the_process_is_gone() -> None:
    assert parent_pid(os.getpid()) == os.getppid()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert parent_pid(child.pid) == os.getpid()
    finally:
        child.kill()
        child.wait()
    assert parent_pid(child.pid) is None
