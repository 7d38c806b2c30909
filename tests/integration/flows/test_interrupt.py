"""Ctrl-C to a real `tdeploy run`: its jobs stop, Prefect records the flow run Cancelled, it exits 130."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, TINY_SPEC, deep_merge
from tests.processes import stop_group

pytestmark = pytest.mark.integration

WAIT_S = 600  # a generous wait limit for each stage (the temporary server's cold start is 20-30 s here)


def _start(tmp_path: Path, dataset: str) -> tuple[subprocess.Popen, Path]:
    spec = deep_merge(
        TINY_SPEC,
        {"name": "interrupted", "data": {"dataset_url": dataset}, "checkpoint": {"url": str(tmp_path / "ckpt")},
         "run": {"steps": 100_000, "output_url": str(tmp_path / "runs" / "out")},
         "capacity": {"output_url": str(tmp_path / "runs")}, "image": None},
    )  # fmt: skip
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"), TDEPLOY_HOME=str(tmp_path / "home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
    )  # fmt: skip
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "tdeploy"), "run", str(tmp_path / "spec.yaml")],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, start_new_session=True,
        stdout=open(tmp_path / "stdout.txt", "w"), stderr=open(tmp_path / "stderr.txt", "w"),  # noqa: SIM115
    )  # fmt: skip
    return proc, tmp_path / "runs" / "out"


def _wait_for_ranks(proc: subprocess.Popen, out: Path, tmp_path: Path) -> list[tuple[int, str | None]]:
    """The job's agent and worker pids, once its ranks have started."""
    from training.process import start_time

    deadline = time.monotonic() + WAIT_S
    while not (out / "ranks.json").exists():
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "the training job did not start"
        time.sleep(0.5)
    job = json.loads((out / "job.json").read_text())
    ranks = json.loads((out / "ranks.json").read_text())["ranks"]
    return [(a["pid"], a["start_time"]) for a in job["details"]["agents"]] + [
        (r["pid"], start_time(r["pid"])) for r in ranks
    ]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _prefect_states(prefect_home: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """The flow runs' and task runs' state types, read from the temporary server's database."""
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        flows = [row[0] for row in db.execute("select state_type from flow_run")]
        tasks = list(db.execute("select name, state_type from task_run"))
    return flows, tasks


@pytest.mark.timeout(900)
def test_ctrl_c_cancels_the_run_stops_its_jobs_and_records_the_flow_run_cancelled(
    tiny_dataset: str, tmp_path: Path
) -> None:
    from training.process import alive

    proc, out = _start(tmp_path, tiny_dataset)
    try:
        started = _wait_for_ranks(proc, out, tmp_path)
        assert all(alive(*p) for p in started)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        code = proc.wait(timeout=120)
    finally:
        stop_group(proc)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 130, stderr[-3000:]
    assert "cancelled by SIGINT" in stderr and "is Cancelled" in stderr
    assert [p for p in started if alive(*p)] == []
    assert not _group_alive(proc.pid)
    flows, tasks = _prefect_states(tmp_path / "prefect")
    assert flows == ["CANCELLED"], stderr[-3000:]
    assert not [t for t in tasks if t[1] in ("RUNNING", "PENDING", "CRASHED")], tasks
    assert any(name.startswith("submit_job") and state == "CANCELLED" for name, state in tasks), tasks


def test_the_temporary_prefect_server_dies_with_a_tdeploy_run_killed_outright(tmp_path: Path) -> None:
    # The server runs in a session of its own (so the terminal's Ctrl-C leaves it to record the cancellation);
    # a SIGKILL to its owner must still not leave it behind.
    owner = tmp_path / "owner.py"
    owner.write_text(
        "import time\nfrom tasks.launch.interrupt import PrefectServer\n"
        "server = PrefectServer()\nserver.start(600)\nprint(server.proc.pid, flush=True)\ntime.sleep(3600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = subprocess.Popen(
        [sys.executable, str(owner)], cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    server_pid = None
    try:
        server_pid = int(proc.stdout.readline())
        assert os.getsid(server_pid) == server_pid  # not in its owner's session
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while _running(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(server_pid), "the temporary Prefect server outlived the tdeploy run that started it"
    finally:
        stop_group(proc)
        if server_pid is not None and _running(server_pid):
            os.killpg(server_pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
