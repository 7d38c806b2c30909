"""The drills step reuses the acceptance step's uninterrupted run and rank_kill drill from the same workspace,
and only when they are what the drills would run themselves."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext, reuse_acceptance
from tasks.acceptance.record import AcceptanceReport, DrillResult
from tasks.acceptance.suite import ACCEPTANCE_COMM_PROBE_MB
from tasks.acceptance.workspace import variant
from tasks.launch.base import JobHandle
from training.run_output import RunOutputWriter, RunResult
from training.storage import StorageConfig

ACCEPTANCE = AcceptanceConfig(steps=40, save_every_steps=10)


def _workspace(tmp_path: Path, make_spec, steps: int = 40, rank_kill_passed: bool = True) -> DrillContext:
    """A run workspace as the acceptance step leaves it: its report, the distributed run's folder."""
    spec = make_spec()
    train = spec.training_config()
    run = {"steps": steps, "comm_probe_mb": ACCEPTANCE_COMM_PROBE_MB}  # as the acceptance step's distributed run
    dist = variant(train, tmp_path, "distributed", run=run, checkpoint={"save_every_steps": 10})
    out = Path(dist.run.output_url)
    out.mkdir(parents=True)
    dist.to_json_file(out / "run.json")
    handle = JobHandle("local", "123", "accept-distributed", str(out), str(out / "train.log"))
    (out / "job.json").write_text(json.dumps(handle.to_json()))
    writer = RunOutputWriter(str(out), StorageConfig())
    writer.write_result(RunResult(steps, None, 2, 5.5, 4.0, 4.1, 60.3, 0, 1000, 100))
    writer.close()
    kill = DrillResult(name="rank_kill", passed=rank_kill_passed, recovery_s=3.0, steps_lost=5,
                       state_matched=rank_kill_passed, evidence={"killed_rank": 1})  # fmt: skip
    AcceptanceReport(dimensions=[], drills=[kill], runs={"distributed": str(out)}).write(tmp_path)
    return DrillContext(spec.cluster, train, tmp_path / "drills", ACCEPTANCE)


def test_the_acceptance_steps_run_and_passed_rank_kill_are_reused(tmp_path: Path, make_spec) -> None:
    ctx = _workspace(tmp_path, make_spec)
    reference, rank_kill = reuse_acceptance(tmp_path, ctx)
    assert reference is not None and reference.ok
    assert reference.output_dir == tmp_path / "distributed" / "output"
    assert rank_kill is not None and rank_kill.passed and rank_kill.evidence["killed_rank"] == 1
    assert rank_kill.evidence["reused_from"] == str(AcceptanceReport.path_in(tmp_path))


def test_a_run_of_another_job_is_not_reused(tmp_path: Path, make_spec) -> None:
    ctx = _workspace(tmp_path, make_spec)
    reseeded = ctx.base.run.model_copy(update={"seed": ctx.base.run.seed + 1})
    other = DrillContext(ctx.cluster, ctx.base.model_copy(update={"run": reseeded}), ctx.root, ACCEPTANCE)
    assert reuse_acceptance(tmp_path, other) == (None, None)


def test_a_run_of_another_length_is_not_reused(tmp_path: Path, make_spec) -> None:
    ctx = _workspace(tmp_path, make_spec, steps=80)  # a nightly soak, say
    assert reuse_acceptance(tmp_path, ctx) == (None, None)


def test_a_failed_rank_kill_is_run_again_but_the_run_is_reused(tmp_path: Path, make_spec) -> None:
    ctx = _workspace(tmp_path, make_spec, rank_kill_passed=False)
    reference, rank_kill = reuse_acceptance(tmp_path, ctx)
    assert reference is not None and rank_kill is None


def test_a_workspace_without_an_acceptance_step_reuses_nothing(tmp_path: Path, make_spec) -> None:
    ctx = _workspace(tmp_path, make_spec)
    AcceptanceReport.path_in(tmp_path).write_text("{not json")
    assert reuse_acceptance(tmp_path, ctx) == (None, None)
    AcceptanceReport.path_in(tmp_path).unlink()
    assert reuse_acceptance(tmp_path, ctx) == (None, None)
