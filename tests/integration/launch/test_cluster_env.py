"""The spec's cluster.env reaches every rank of a real job on each launcher; the job environment (test faults)
travels and is recorded apart.

Each job pauses after its first step (a test fault) so that its ranks' environments can be read from
/proc/<pid>/environ; the test then stops exactly that job through its launcher.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tasks.launch.base import JobHandle, JobState, Launcher, find_job
from tasks.launch.local import run_local
from tasks.launch.network import ALLOWED_ENV_VAR
from tasks.launch.slurm import SlurmLauncher
from tasks.launch.submit import submit
from tests.conftest import process_running
from tests.faults.bugs import ENV_VAR
from tests.faults.job import injected
from training.run_output import RunOutput

pytestmark = pytest.mark.integration

SPEC_ENV = {"JOB_NOTE": "from the spec: $HOME 'quoted' \"too\"", "NCCL_DEBUG": "WARN"}
FAULTS = injected(pause_after_step=1)


@pytest.fixture(autouse=True)
def operator_allows_job_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """JOB_NOTE is no library's variable, so not on cluster.env's allow-list: the operator allows it here."""
    monkeypatch.setenv(ALLOWED_ENV_VAR, "JOB_NOTE")


def _environ(pid: int) -> dict[str, str]:
    """The environment a process started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.decode().partition("=")[::2] for entry in raw.split(b"\0") if entry)


def _rank_pids(output_dir: str, world_size: int, timeout_s: float = 300) -> list[int]:
    """The worker pids once every rank has recorded itself."""
    deadline = time.monotonic() + timeout_s
    while (ranks := RunOutput(output_dir).ranks()) is None or len(ranks.ranks) < world_size:
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    return [rank["pid"] for rank in ranks.ranks]


def _assert_environments(pids: list[int]) -> None:
    for pid in pids:
        env = _environ(pid)
        assert {key: env.get(key) for key in SPEC_ENV} == SPEC_ENV, f"rank pid {pid} lacks cluster.env"
        assert env.get(ENV_VAR) == FAULTS.plugin_env[ENV_VAR], f"rank pid {pid} lacks the faults"


def _assert_recorded_apart(handle: JobHandle) -> None:
    recorded = find_job(handle.output_dir)
    assert recorded.env == SPEC_ENV and ENV_VAR not in recorded.env
    assert recorded.extra_env == FAULTS.variables() and not set(SPEC_ENV) & set(recorded.extra_env)


def _stop(launcher: Launcher, handle: JobHandle, pids: list[int]) -> None:
    launcher.cancel(handle)
    assert launcher.wait(handle, timeout_s=120).state is JobState.CANCELLED
    deadline = time.monotonic() + 60
    while any(process_running(pid) for pid in pids):
        assert time.monotonic() < deadline, "ranks outlived the cancel"
        time.sleep(0.2)


def test_cluster_env_and_the_faults_reach_every_rank_of_a_local_job_and_are_recorded_apart(
    make_spec, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    spec = make_spec({"cluster": {"env": SPEC_ENV}, "run": {"steps": 20}})
    launcher, handle = submit(spec.cluster, spec.training_config(), "env", environment=FAULTS)
    pids: list[int] = []
    try:
        pids = _rank_pids(handle.output_dir, 2)
        _assert_environments(pids)
        _assert_recorded_apart(handle)
    finally:
        _stop(launcher, handle, pids)


class _Seen(Exception):
    """Raised from the log callback once the ranks' environments are read: run_local then cancels its job."""

    def __init__(self, environments: dict[int, dict[str, str]]) -> None:
        super().__init__("environments read")
        self.environments = environments


def test_run_local_which_tdeploy_train_uses_gives_every_rank_cluster_env(make_spec) -> None:
    spec = make_spec({"cluster": {"env": SPEC_ENV}, "run": {"steps": 20}})
    out = spec.run.output_url

    def on_line(line: str) -> None:
        if "test fault: pausing after step" in line:
            raise _Seen({pid: _environ(pid) for pid in _rank_pids(out, 2)})

    with pytest.raises(_Seen) as seen:
        run_local(spec.cluster, spec.training_config(), on_line=on_line, environment=FAULTS)
    assert len(seen.value.environments) == 2
    for pid, env in seen.value.environments.items():
        assert {key: env.get(key) for key in SPEC_ENV} == SPEC_ENV, f"rank pid {pid} lacks cluster.env"
        assert not process_running(pid), "run_local cancels its job when the caller stops waiting"


def test_cluster_env_and_the_faults_reach_every_rank_of_a_slurm_job_and_are_recorded_apart(
    slurm_cluster, make_spec
) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "env": SPEC_ENV}, "run": {"steps": 20}})
    launcher = SlurmLauncher(slurm_cluster)
    handle = launcher.submit(spec.cluster, spec.training_config(), "tdeploy-env", environment=FAULTS)
    pids: list[int] = []
    try:
        pids = _rank_pids(handle.output_dir, 2)
        _assert_environments(pids)
        _assert_recorded_apart(handle)
    finally:
        _stop(launcher, handle, pids)
