"""Preemption: what the trainer does on a scheduler's termination or warning signal, and how it says so.

The contract with the launchers: on SIGTERM (Slurm preemption, Kubernetes eviction, torchrun's shutdown) or
SIGUSR1 (Slurm's `--signal=USR1@N` warning before the time limit), every rank finishes its current step, the
job writes a checkpoint (the usual commit protocol), rank 0 appends one JSON line to
`<output_dir>/preemptions.jsonl`, and every worker exits with PREEMPTED_EXIT_CODE ("requeue me").

The signal handler only records the signal (`WATCH`): the step, an evaluation or a checkpoint save in progress
goes on untouched. At each step boundary the ranks agree whether any of them was signalled (the flags ride on
the step's loss all-reduce, so agreeing costs no extra collective), and the trainer stops there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from training import process, worker_start
from training.storage import StorageConfig, append_control_line, read_control_lines

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL (sysexits.h): the job stopped on request after saving; run it again to go on."""
PREEMPTIONS_FILE = "preemptions.jsonl"
"""One JSON object per preemption, appended by rank 0: step, signal, signal_to_exit_s, checkpoint, time."""
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that mean "checkpoint at the next step boundary and stop", in the order of `flags()`."""


@dataclass(frozen=True)
class Request:
    """The first preemption signal this process got."""

    signal: str
    monotonic_s: float
    unix_s: float


class PreemptionWatch:
    """Records the first SIGTERM or SIGUSR1; nothing else happens in the handler (a later one is ignored)."""

    def __init__(self) -> None:
        self.request: Request | None = None

    def install(self) -> bool:
        """Catch SIGTERM and SIGUSR1 from now on; False off the main thread (Python handles signals there only)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """SIGTERM and SIGUSR1 terminate the process again (their default action)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.request is None:
            self.request = Request(signal.Signals(signum).name, time.monotonic(), time.time())

    def flags(self) -> list[float]:
        """1.0 for each signal of SIGNALS this process got, else 0.0 (summed over ranks: > 0 = some rank got it)."""
        got = self.request.signal if self.request else None
        return [1.0 if got == sig.name else 0.0 for sig in SIGNALS]


WATCH = PreemptionWatch()
"""This process's watch; the trainer installs it first thing in every worker."""


def agreed_signal(summed_flags: list[float]) -> str | None:
    """The signal some rank got, from the flags summed (or averaged) over the ranks; None when none did."""
    for sig, value in zip(SIGNALS, summed_flags, strict=True):
        if value > 0:
            return sig.name
    return None


@dataclass(frozen=True)
class PreemptionRecord:
    """One line of preemptions.jsonl."""

    step: int
    signal: str
    signal_to_exit_s: float
    checkpoint: str
    time: float
    run_id: str | None = None
    world_size: int | None = None

    def describe(self) -> str:
        """One line for people."""
        return f"preempted at step {self.step} by {self.signal}; resubmit to resume from checkpoint step {self.step}"


class PreemptionFileError(ValueError):
    """preemptions.jsonl holds a line that is not a preemption record."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        super().__init__(
            f"{path} line {line}: {problem}; it is written only by the trainer: remove that line (or the file) "
            "if it was edited by hand"
        )


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "signal": str,
    "signal_to_exit_s": (int, float),
    "checkpoint": str,
    "time": (int, float),
}


def _record(data: Any, path: str, line: int) -> PreemptionRecord:
    if not isinstance(data, dict):
        raise PreemptionFileError(path, line, "not a JSON object")
    for name, kind in _FIELDS.items():
        value = data.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise PreemptionFileError(path, line, f"field {name!r} is {value!r}, not a {kind}")
    if data["signal"] not in {s.name for s in SIGNALS}:
        raise PreemptionFileError(path, line, f"signal {data['signal']!r} is not one of SIGTERM, SIGUSR1")
    run_id, world = data.get("run_id"), data.get("world_size")
    return PreemptionRecord(
        step=data["step"], signal=data["signal"], signal_to_exit_s=float(data["signal_to_exit_s"]),
        checkpoint=data["checkpoint"], time=float(data["time"]),
        run_id=run_id if isinstance(run_id, str) else None,
        world_size=world if isinstance(world, int) and not isinstance(world, bool) else None,
    )  # fmt: skip


def read_records(output_url: str, storage: StorageConfig | None = None) -> list[PreemptionRecord]:
    """The preemptions recorded in a run's output folder, oldest first ([] when none); PreemptionFileError for a
    malformed line."""
    # a regular file of bounded size (ControlFileError naming it otherwise)
    path, lines = read_control_lines(output_url, PREEMPTIONS_FILE, storage)
    records = []
    for number, text in lines:
        try:
            data = json.loads(text)
        except ValueError as err:
            raise PreemptionFileError(path, number, f"not JSON ({err})") from None
        records.append(_record(data, path, number))
    return records


def records_since(
    output_url: str, since_unix_s: float, run_id: str | None = None, storage: StorageConfig | None = None
) -> list[PreemptionRecord]:
    """The preemptions of one job: recorded at or after `since_unix_s` and, when given, under `run_id`."""
    return [
        r
        for r in read_records(output_url, storage)
        if r.time >= since_unix_s and (run_id is None or r.run_id is None or r.run_id == run_id)
    ]


def append_record(output_url: str, record: PreemptionRecord, storage: StorageConfig | None = None) -> None:
    """Add one line to preemptions.jsonl, replacing the file as a whole (readers never see half a line)."""
    append_control_line(output_url, PREEMPTIONS_FILE, json.dumps(asdict(record)), storage)


def _config_path(argv: list[str]) -> str | None:
    """The trainer's `--config` path among torchrun's arguments (after the payload module)."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "--config":
            return argv[i + 1]
    return None


def job_was_preempted(argv: list[str], since_unix_s: float) -> bool:
    """Whether the trainer this torchrun agent ran recorded a preemption since `since_unix_s` (the agent's start):
    its workers checkpointed and exited with PREEMPTED_EXIT_CODE."""
    from training.config import TrainConfig  # noqa: PLC0415 - only after a signal or failure

    path = _config_path(argv)
    if path is None:
        return False
    try:
        cfg = TrainConfig.from_json_file(path)
        return bool(records_since(cfg.run.output_url, since_unix_s, storage=cfg.storage))
    except (OSError, ValueError) as err:  # unreadable config or record: not a preemption this agent can vouch for
        print(f"preemption record unreadable: {err}", flush=True)  # noqa: T201 - the agent's log
        return False


def _one_preemption_signal() -> None:
    """Make torchrun's signal handler raise on the first SIGTERM or SIGUSR1 only. Its handler raises
    SignalException on every signal, and one raised while the agent waits for its workers to checkpoint (Slurm's
    warning followed by its SIGTERM; a signal sent to the agent and again to its whole step) ends that wait and
    the agent, and the workers with it, before their checkpoint is written. Other signals (SIGINT) still raise."""
    from torch.distributed.elastic.multiprocessing import api  # noqa: PLC0415

    original = getattr(api, "_terminate_process_handler", None)
    if original is None or getattr(original, "tdeploy_once", False):
        return
    raised: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if signum in SIGNALS and raised:
            first = signal.Signals(raised[0]).name
            print(f"{signal.Signals(signum).name} ignored: the workers are stopping on {first}", flush=True)  # noqa: T201
            return
        if signum in SIGNALS:
            raised.append(signum)
        original(signum, frame)

    handler.tdeploy_once = True  # type: ignore[attr-defined]
    api._terminate_process_handler = handler  # PContext.start() registers it by this name


def _kill_stopped_workers_on_close() -> None:
    """Make torchrun's worker teardown SIGKILL a worker that is stopped when it is sent its closing signal. A
    stopped process (a frozen rank: SIGSTOP, a job-control stop) cannot act on SIGTERM until it is continued,
    which nobody does, so torchrun's restart waited its whole grace (30 s, not configurable for a restart) for
    nothing before its own SIGKILL: the hang the soak injects cost that on every recovery. Running workers are
    untouched (they get SIGTERM and the grace as before)."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (  # noqa: PLC0415
            subprocess_handler as module,
        )
    except ImportError:  # another torch layout: torchrun's own teardown applies
        return
    handler_class = getattr(module, "SubprocessHandler", None)
    original = getattr(handler_class, "close", None)
    if original is None or getattr(original, "tdeploy_kills_stopped", False):
        return

    def close(self: Any, death_sig: signal.Signals | None = None) -> None:
        stopped = death_sig != signal.SIGKILL and self.proc.poll() is None and process.stopped(self.proc.pid)
        original(self, death_sig)
        if stopped:
            print(f"worker pid {self.proc.pid} is stopped (it cannot act on {death_sig}): killed", flush=True)  # noqa: T201
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    close.tdeploy_kills_stopped = True  # type: ignore[attr-defined]
    handler_class.close = close
    _kill_stopped_forked_workers_on_close()


def _kill_stopped_forked_workers_on_close() -> None:
    """The same for workers forked from the agent (training/worker_start.py: torchrun's MultiprocessContext)."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext  # noqa: PLC0415

    original = MultiprocessContext._close
    if getattr(original, "tdeploy_kills_stopped", False):
        return

    def _close(self: Any, death_sig: signal.Signals, timeout: int = 30) -> None:
        procs = self._pc.processes if self._pc is not None else []
        stopped = [p.pid for p in procs if death_sig != signal.SIGKILL and p.is_alive() and process.stopped(p.pid)]
        for pid in stopped:  # before the wait: a stopped worker cannot act on death_sig
            print(f"worker pid {pid} is stopped (it cannot act on {death_sig}): killed", flush=True)  # noqa: T201
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        original(self, death_sig, timeout)

    _close.tdeploy_kills_stopped = True  # type: ignore[attr-defined]
    MultiprocessContext._close = _close


def run_torchrun(argv: list[str]) -> int:
    """Run torchrun (`python -m torch.distributed.run argv`) in this process; its exit code, and
    PREEMPTED_EXIT_CODE where the job stopped by preemption.

    torchrun ends on a signal it handles (`--signals-to-handle`) by passing it to the workers, waiting up to
    `--shutdown-timeout` seconds and raising SignalException (exit 1); and on workers that exited by themselves
    with a non-zero code, by ChildFailedError (exit 1). Either way, when the trainer recorded a preemption (or
    every failed worker exited with PREEMPTED_EXIT_CODE), this returns PREEMPTED_EXIT_CODE instead, so a
    scheduler that sees only the agent's status (a Kubernetes pod, a Slurm step) sees "requeue me".
    """
    import runpy  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError  # noqa: PLC0415

    _one_preemption_signal()
    _kill_stopped_workers_on_close()
    worker_start.install()
    started = time.time()
    sys.argv = ["torch.distributed.run", *argv]
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SystemExit as done:  # torchrun's own exit
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except SignalException:
        if job_was_preempted(argv, started):
            return PREEMPTED_EXIT_CODE
        raise
    except ChildFailedError as failed:
        codes = {failure.exitcode for failure in failed.failures.values()}
        if codes == {PREEMPTED_EXIT_CODE} or job_was_preempted(argv, started):
            return PREEMPTED_EXIT_CODE
        raise
    except RendezvousConnectionError:
        from training.spares import job_finished_since  # noqa: PLC0415 - only when the store went away

        if job_finished_since(_config_path(argv), started):  # a hot spare left standing by the finished job
            print("rendezvous store gone after the job finished: a spare stood by unneeded", flush=True)  # noqa: T201
            return 0
        raise
    return 0


if __name__ == "__main__":  # the agent of a pod: `python -m training.preemption <torchrun arguments>`
    import sys

    code = run_torchrun(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
