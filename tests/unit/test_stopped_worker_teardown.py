"""torchrun's worker teardown (run_torchrun's agent) kills a stopped worker instead of waiting its grace for a
SIGTERM the worker cannot act on; running workers still get SIGTERM."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

from training import preemption, process

SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: exit(7)); time.sleep(120)"


def _handler() -> SubprocessHandler:
    handler = SubprocessHandler(sys.executable, ("-c", SLEEPER), env={}, stdout=None, stderr=None, local_rank_id=0,
                                numa_options=None)
    assert handler.proc.poll() is None
    return handler


@pytest.fixture
def patched() -> None:
    preemption._kill_stopped_workers_on_close()


def test_a_stopped_worker_is_killed_by_its_closing_signal(patched: None) -> None:
    handler = _handler()
    try:
        handler.proc.send_signal(signal.SIGSTOP)
        while not process.stopped(handler.proc.pid):  # the stop is asynchronous
            pass
        handler.close(signal.SIGTERM)
        # Before the change the stopped worker stays stopped (the wait times out): torchrun then waited 30 s.
        assert handler.proc.wait(timeout=20) == -signal.SIGKILL
    finally:
        if handler.proc.poll() is None:
            handler.proc.kill()
            handler.proc.wait()


def test_a_running_worker_still_gets_sigterm(patched: None) -> None:
    handler = _handler()
    try:
        while not _handles_sigterm(handler.proc.pid):  # its handler installed: a SIGTERM before would kill it
            pass
        handler.close(signal.SIGTERM)
        assert handler.proc.wait(timeout=20) == 7
    finally:
        if handler.proc.poll() is None:
            handler.proc.kill()
            handler.proc.wait()


def _handles_sigterm(pid: int) -> bool:
    """The process has its SIGTERM handler installed (SigCgt has SIGTERM's bit)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))
