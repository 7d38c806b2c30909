"""The Slurm launcher against a real single-node Slurm cluster."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.launch.base import JobState, wait_for
from tasks.launch.network import ALLOWED_ENV_VAR
from tasks.launch.slurm import SlurmLauncher
from tests.conftest import process_running
from tests.faults.job import injected

pytestmark = pytest.mark.integration


def test_training_job_runs_two_ranks_to_completion_through_sbatch(slurm_cluster, make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm"}, "run": {"steps": 10}, "checkpoint": {"save_every_steps": 5}})
    launcher = SlurmLauncher(slurm_cluster)
    handle = launcher.submit(spec.cluster, spec.training_config(), "tdeploy-test")
    assert handle.job_id.isdigit()
    seen = []
    deadline = time.monotonic() + 300
    while not (status := launcher.status(handle)).state.terminal:
        if not seen or seen[-1] != status.state:
            seen.append(status.state)
        assert time.monotonic() < deadline, launcher.logs(handle)[0][-20:]
        time.sleep(0.3)
    assert status.state is JobState.SUCCEEDED, "\n".join(launcher.logs(handle)[0][-40:])
    assert JobState.RUNNING in seen
    ranks = json.loads(Path(spec.run.output_url, "ranks.json").read_text())
    assert ranks["world_size"] == 2
    assert (Path(spec.checkpoint.url) / "step-00000010" / "COMMIT.json").exists()
    assert any("tdeploy: job" in line for line in launcher.logs(handle)[0])
    node_logs = sorted(Path(spec.run.output_url, "logs").glob("*/*/attempt_0/*/stderr.log"))
    assert {p.relative_to(spec.run.output_url).parts[1] for p in node_logs} == {"localhost"}, "named after the node"
    assert len(node_logs) == 2, "one log per rank"


def test_shell_syntax_in_the_output_path_env_and_sbatch_options_is_taken_literally(
    slurm_cluster, make_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALLOWED_ENV_VAR, "JOB_NOTE")  # no library's variable: the operator allows it
    marker = tmp_path / "pwned"
    odd = tmp_path / f'out $(touch {marker}) `touch {marker}` it\'s #1 100% "q"'
    spec = make_spec(
        {
            "cluster": {
                "scheduler": "slurm",
                "env": {"JOB_NOTE": f"'; touch {marker}; ' $(touch {marker})"},
                "slurm": {"extra_args": [f"--comment=x;touch&{marker}|y"]},
            },
            "run": {"output_url": str(odd), "steps": 2},
        }
    )
    launcher = SlurmLauncher(slurm_cluster)
    handle = launcher.submit(spec.cluster, spec.training_config(), "tdeploy-odd")
    status = wait_for(launcher, handle, timeout_s=300)
    assert status.state is JobState.SUCCEEDED, "\n".join(launcher.logs(handle)[0][-40:])
    assert Path(handle.log_path).parent == odd, "sbatch read the quoted --output directive whole"
    assert json.loads((odd / "ranks.json").read_text())["world_size"] == 2
    assert not marker.exists(), "a spec value ran as shell code"


def test_scancel_cancels_a_running_job(slurm_cluster, make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm"}, "run": {"steps": 50}})
    launcher = SlurmLauncher(slurm_cluster)
    faults = injected(pause_after_step=2)
    handle = launcher.submit(spec.cluster, spec.training_config(), "tdeploy-cancel", environment=faults)
    ranks_file = Path(spec.run.output_url, "ranks.json")
    wait_for(launcher, handle, frozenset({JobState.RUNNING}), timeout_s=300)
    deadline = time.monotonic() + 300
    while not ranks_file.exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    workers = [r["pid"] for r in json.loads(ranks_file.read_text())["ranks"]]
    launcher.cancel(handle)
    status = wait_for(launcher, handle, timeout_s=120)
    assert status.state is JobState.CANCELLED, status
    deadline = time.monotonic() + 60
    while any(process_running(pid) for pid in workers):
        assert time.monotonic() < deadline, "workers outlived scancel"
        time.sleep(0.2)


def test_a_squeue_without_json_falls_back_to_the_text_of_squeue_and_scontrol(
    slurm_cluster, make_spec, tmp_path: Path
) -> None:
    """Slurm before 21.08 (or without the serializer/json plugin) refuses `squeue --json` as this shim does."""
    shim = tmp_path / "bin" / "squeue"
    shim.parent.mkdir()
    real = shutil.which("squeue")
    assert real is not None
    shim.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = --json ] && { echo "squeue: unrecognized option --json" >&2; exit 1; }; done\n'
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    spec = make_spec({"cluster": {"scheduler": "slurm"}, "run": {"steps": 2}})
    launcher = SlurmLauncher({**slurm_cluster, "PATH": f"{shim.parent}:{os.environ['PATH']}"})
    handle = launcher.submit(spec.cluster, spec.training_config(), "tdeploy-text")
    status = wait_for(launcher, handle, timeout_s=300)
    assert status.state is JobState.SUCCEEDED, "\n".join(launcher.logs(handle)[0][-40:])
    assert launcher._json is False, "the launcher noticed that this squeue has no --json"
    assert launcher.restarts(handle) == 0 and launcher.queue_seconds(handle) is not None


def test_an_impossible_request_is_rejected_with_slurms_reason(slurm_cluster, make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "nodes": 3, "procs_per_node": 1}})
    with pytest.raises(UserError, match=r"sbatch failed: .*(More processors requested than permitted|Node count)"):
        SlurmLauncher(slurm_cluster).submit(spec.cluster, spec.training_config(), "too-big")


def test_an_unknown_partition_names_the_valid_ones(slurm_cluster, make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "slurm": {"partition": "gpu-large"}}})
    with pytest.raises(
        UserError, match=r"cluster\.slurm\.partition=gpu-large: no such partition; use one of \['debug'\]"
    ):
        SlurmLauncher(slurm_cluster).submit(spec.cluster, spec.training_config(), "bad-partition")


def test_missing_scheduler_tools_are_named(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm"}})
    with pytest.raises(UserError, match=r"`sbatch` is not on PATH; install the Slurm client tools"):
        SlurmLauncher({"PATH": str(tmp_path)}).submit(spec.cluster, spec.training_config(), "no-tools")


def test_rank_kill_and_reshard_drills_recover_through_slurm(slurm_cluster, make_spec, tmp_path, monkeypatch) -> None:
    from tasks.acceptance.config import AcceptanceConfig
    from tasks.acceptance.drill_table import run_drills
    from tasks.acceptance.drills import DrillContext

    for key, value in slurm_cluster.items():
        monkeypatch.setenv(key, value)
    spec = make_spec({"cluster": {"scheduler": "slurm"}})
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path / "drills", AcceptanceConfig(steps=200))
    results = {r.name: r for r in run_drills(ctx, ["rank_kill", "reshard"])}
    for name, result in results.items():
        assert result.passed and result.state_matched, (name, result.message, result.evidence)
    assert results["rank_kill"].evidence["relaunched"]  # Slurm ended the job; the drill resubmitted it
    assert results["reshard"].evidence["to_world_size"] == 1
