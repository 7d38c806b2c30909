"""Interrupting a supervising command (`tdeploy run`): SIGINT/SIGTERM stop its jobs, a second signal exits at once.

The first signal stops every supervised job this process started (by pid, in a thread, so that
no new job starts while the flow unwinds) and raises KeyboardInterrupt in the main thread; the
command then records the cancellation and exits with 128 + the signal's number. A second signal
kills what is left and exits at once. Prefect replaces the SIGTERM handler while a flow runs
(its TerminationSignal ends the flow the same way): the command calls `interrupted(...)` when it
catches that.

The temporary Prefect server runs in a session of its own (`PrefectServer`), so that the terminal's
Ctrl-C, sent to the whole foreground process group, does not stop it before the cancellation
is recorded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType

from tasks.launch.local import kill_supervised_jobs, stop_supervised_jobs
from training.network import listen_port

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class InterruptGuard:
    """While active: the first SIGINT/SIGTERM stops the jobs and raises KeyboardInterrupt; a second exits now."""

    def __init__(self, on_second: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        self._on_second = on_second
        self._stopper: threading.Thread | None = None
        self._previous: dict[int, object] = {}

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as shells report it."""
        return 128 + (self.signum or signal.SIGINT)

    @property
    def signal_name(self) -> str:
        """`SIGINT` or `SIGTERM`."""
        return signal.Signals(self.signum or signal.SIGINT).name

    def __enter__(self) -> InterruptGuard:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def interrupted(self, signum: int) -> None:
        """Note the first interrupt (from a handler, or a TerminationSignal Prefect raised) and start stopping jobs."""
        if self.signum is not None:
            return
        self.signum = signum
        self._stopper = threading.Thread(target=stop_supervised_jobs, name="stop-jobs", daemon=True)
        self._stopper.start()

    def wait_for_jobs(self) -> None:
        """Until every supervised job has stopped (after an interrupt)."""
        if self._stopper is not None:
            self._stopper.join()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: no more waiting
            kill_supervised_jobs()
            if self._on_second:
                self._on_second(signum)
            os._exit(128 + signum)
        self.interrupted(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)


class PrefectServerFailed(RuntimeError):
    """The temporary Prefect server did not answer its health check."""


_DIE_WITH_PARENT_THEN_EXEC = (
    "import os, sys; from training.process import die_with_parent; die_with_parent(); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


class PrefectServer:
    """Prefect's temporary API server (as Prefect's own ephemeral mode starts it), in a session of its own."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or listen_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        """What PREFECT_API_URL must say."""
        return f"http://127.0.0.1:{self.port}/api"

    def start(self, timeout_s: float) -> None:
        """Start it and wait until /health answers."""
        import httpx
        import prefect
        from prefect.settings import get_current_settings

        env = {
            **os.environ,
            **get_current_settings().to_environment_variables(exclude_unset=True),
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        env.pop("PREFECT_API_URL", None)
        uvicorn = ["-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent)]
        uvicorn += ["--factory", "prefect.server.api.server:create_app"]
        uvicorn += ["--host", "127.0.0.1", "--port", str(self.port)]
        uvicorn += ["--log-level", "error", "--lifespan", "on"]
        # Its own session keeps the terminal's Ctrl-C off it; the parent-death signal (kept across exec) stops it
        # when `tdeploy run` itself is killed outright, so a server is never left behind.
        args = [sys.executable, "-c", _DIE_WITH_PARENT_THEN_EXEC, *uvicorn]
        self.proc = subprocess.Popen(args, env=env, start_new_session=True)
        log.info("starting a temporary Prefect server on 127.0.0.1:%d (pid %d)", self.port, self.proc.pid)
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise PrefectServerFailed(f"the temporary Prefect server exited with {self.proc.returncode}")
                try:
                    if client.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise PrefectServerFailed(
            f"the temporary Prefect server did not answer in {timeout_s:.0f}s; "
            "raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS or start one with `prefect server start`"
        )

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM its process group, SIGKILL it after `grace_s`."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None
