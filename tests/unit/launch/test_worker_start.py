"""Workers forked from their agent (training/worker_start.py): what the agent forks, and what a forked worker
sees (its session, default signals, its exit code, its traceback), checked in real forked processes."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tasks.launch.cluster import ClusterConfig
from tasks.launch.torchrun import job_env, payload_args
from training import process, worker_start
from training.worker_start import WORKER_START_ENV, forkable_payload, run_forked

PAYLOAD = '''
import os, signal, sys
def main(argv):
    record = {
        "argv": sys.argv,
        "sid_is_pid": os.getsid(0) == os.getpid(),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
        "sigint_python": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "parent_known": __import__("training.process", fromlist=["x"])._PARENT_AT_IMPORT == os.getppid(),
        "how": __import__("training.worker_start", fromlist=["x"]).how_started(),
    }
    with open(argv[0], "w") as out:
        out.write(repr(record))
    if argv[1] == "raise":
        raise RuntimeError("payload failed: LeaseRefused")
    return int(argv[1])
'''


def test_only_the_training_payload_started_as_a_module_is_forked() -> None:
    module_cmd = ["-u", *payload_args("/out/run.json")]
    assert forkable_payload(sys.executable, module_cmd) == ("training.train", ["--config", "/out/run.json"])
    assert forkable_payload(sys.executable, ["-u", "-m", "training.other", "--config", "x"]) is None
    assert forkable_payload(sys.executable, ["-u", "script.py"]) is None
    assert forkable_payload("/usr/bin/env", module_cmd) is None  # --no-python: a binary of its own
    assert forkable_payload(sys.executable, ["-u", "-m"]) is None


def test_cpu_jobs_fork_their_workers_and_gpu_jobs_start_interpreters() -> None:
    cpu = ClusterConfig(scheduler="local", nodes=1, procs_per_node=2)
    gpu = cpu.model_copy(update={"accelerator": "h100-sxm"})
    assert job_env(cpu, inherited={})[WORKER_START_ENV] == "fork"
    assert WORKER_START_ENV not in job_env(gpu, inherited={})
    assert job_env(cpu, inherited={WORKER_START_ENV: "exec"})[WORKER_START_ENV] == "exec"  # the operator's choice


def _fork_and_run(tmp_path: Path, code: str) -> tuple[int, dict, str]:
    """Run PAYLOAD's main in a forked child of a process that handles SIGTERM and SIGUSR1 as torchrun's agent
    does; (exit status as waitstatus_to_exitcode, the payload's record, the child's stderr)."""
    (tmp_path / "forked_payload.py").write_text(PAYLOAD)
    sys.path.insert(0, str(tmp_path))
    record, err = tmp_path / "record.txt", tmp_path / "stderr.txt"
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        pid = os.fork()
        if pid == 0:  # the worker
            try:
                sys.stderr = open(err, "w")  # noqa: SIM115 - the worker's stderr until it exits
                run_forked("forked_payload", [str(record), code])
                os._exit(0)
            except BaseException:  # noqa: BLE001 - the exit status says it
                os._exit(1)
        _, status = os.waitpid(pid, 0)
    finally:
        sys.path.remove(str(tmp_path))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return os.waitstatus_to_exitcode(status), eval(record.read_text()), err.read_text()  # noqa: S307 - our repr


def test_a_forked_worker_runs_in_its_own_session_with_default_signals(tmp_path: Path) -> None:
    code, record, _ = _fork_and_run(tmp_path, "0")
    assert code == 0
    assert record["argv"] == ["forked_payload", str(tmp_path / "record.txt"), "0"]
    assert record["sid_is_pid"], "a worker leads a session of its own, as torchrun starts one"
    assert record["sigterm_default"] and record["sigusr1_default"], "the agent's handlers must not run in it"
    assert record["sigint_python"]
    assert record["parent_known"], "die_with_parent must know the agent as the parent"
    assert record["how"] == "fork"
    assert worker_start.how_started() == "exec" and process._PARENT_AT_IMPORT != 0


def test_a_forked_worker_exits_with_the_payloads_code(tmp_path: Path) -> None:
    code, _, _ = _fork_and_run(tmp_path, "75")  # PREEMPTED_EXIT_CODE: torchrun reads it from the exit status
    assert code == 75


def test_a_forked_workers_failure_prints_its_traceback(tmp_path: Path) -> None:
    code, _, err = _fork_and_run(tmp_path, "raise")
    assert code == 1
    assert "RuntimeError: payload failed: LeaseRefused" in err and "Traceback" in err, err


@pytest.mark.parametrize("value", ["", "exec", "forkserver"])
def test_fork_is_asked_for_by_name_only(value: str) -> None:
    assert not worker_start.fork_requested({WORKER_START_ENV: value})
    assert worker_start.fork_requested({WORKER_START_ENV: "fork"})
