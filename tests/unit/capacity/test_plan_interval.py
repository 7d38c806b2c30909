"""`tdeploy plan` prints the checkpoint interval of each tier with its inputs' sources (tasks/capacity/interval.py):
estimated stalls before a run, the ledger's or mttf_hours' MTBF, and the measured stalls of the last run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.capacity.interval import HOST_COPY_BYTES_PER_S, plan_intervals
from tasks.recovery.exposure import FailureRate
from tests.conftest import TINY_SPEC, deep_merge
from training.run_output import CheckpointEvent, RunOutputWriter, StepRecord
from training.storage import StorageConfig


def test_each_tier_s_optimum_from_the_estimated_stall_and_the_planned_step() -> None:
    # 4 GB per rank / 2 GB/s = 2 s per save; step 0.5 s; MTBF 1 h: Daly's 118.67 s = 237 steps for both tiers
    plan = plan_intervals(2 * HOST_COPY_BYTES_PER_S, 0.5, True, None, FailureRate(3600.0, "mttf_hours", "x"), "auto")
    assert [(t.tier, t.stall_s, t.steps) for t in plan.tiers] == [("in-memory copies", 2.0, 237), ("storage", 2.0, 237)]
    assert all(t.stall_source.startswith("estimated") and t.step_source == "planned" for t in plan.tiers)
    sync = plan_intervals(2 * HOST_COPY_BYTES_PER_S, 0.5, False, None, FailureRate(3600.0, "mttf_hours", "x"), "auto")
    assert sync.tiers[1].stall_s == pytest.approx(8.0)  # 4 GB / 0.5 GB/s written while training waits


def _spec(tmp_path: Path, **cluster: object) -> Path:
    raw = deep_merge(TINY_SPEC, {"cluster": cluster, "run": {"output_url": str(tmp_path / "out")},
                                 "checkpoint": {"url": str(tmp_path / "ck")}, "data": {"dataset_url": str(tmp_path)},
                                 "deployment_dir": str(tmp_path)})  # fmt: skip
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _plan_lines(spec: Path, tmp_path: Path) -> list[str]:
    result = CliRunner().invoke(app, ["plan", str(spec), "--out", str(tmp_path / "plan")], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("checkpoint interval"))
    return lines[start:start + 3]


def test_plan_prints_both_tiers_with_mttf_hours_and_estimated_stalls(tmp_path: Path) -> None:
    head, memory, storage = _plan_lines(_spec(tmp_path, nodes=2, mttf_hours=100.0), tmp_path)
    assert "checkpoint.save_every_steps=" in head and "MTBF 50 h (mttf_hours: cluster.mttf_hours=100 / 2" in head
    assert memory.strip().startswith("in-memory copies: every ") and "(estimated: state / 2 GB/s)" in memory
    assert storage.strip().startswith("storage: every ") and "(planned)" in storage


def test_plan_says_the_optimum_is_unknown_without_a_failure_rate(tmp_path: Path) -> None:
    head, memory, storage = _plan_lines(_spec(tmp_path), tmp_path)
    assert "MTBF unknown" in head and "set cluster.mttf_hours" in head
    assert "optimum unknown" in memory and "optimum unknown" in storage


def test_plan_uses_the_last_run_s_measured_stall_and_step(tmp_path: Path) -> None:
    out = RunOutputWriter(str(tmp_path / "out"), StorageConfig())
    for step in range(1, 21):
        out.append_metrics(StepRecord(step=step, loss=1.0, step_time_s=0.5))
    for step in (10, 20):
        out.append_checkpoint(CheckpointEvent(step, 1e6, 3.0, stall_s=2.0))
    out.close()
    _, _, storage = _plan_lines(_spec(tmp_path, mttf_hours=1.0), tmp_path)
    # stall 2 s, step 0.5 s, MTBF 1 h: 237 steps (tests/unit/test_checkpoint_interval.py)
    assert "storage: every 237 step(s)" in storage and "(measured: last run, 2 save(s))" in storage
    assert "step 0.5 s (measured: last run)" in storage


def test_plan_json_carries_both_tiers_and_the_failure_rates_source(tmp_path: Path) -> None:
    spec = _spec(tmp_path, nodes=2, mttf_hours=100.0)
    result = CliRunner().invoke(app, ["plan", str(spec), "--out", str(tmp_path / "plan"), "--json"])
    assert result.exit_code == 0, result.output
    interval = json.loads(result.output)["checkpoint_interval"]
    assert interval["rate"]["mtbf_s"] == pytest.approx(50 * 3600.0) and interval["rate"]["source"] == "mttf_hours"
    assert [tier["tier"] for tier in interval["tiers"]] == ["in-memory copies", "storage"]
    assert all(tier["steps"] >= 1 for tier in interval["tiers"])


def test_plan_json_file_carries_the_interval_plan(tmp_path: Path) -> None:
    """The written plan.json (what the capacity step and `tdeploy plan --out` leave) holds both tiers' intervals."""
    spec = _spec(tmp_path, nodes=2, mttf_hours=100.0)
    result = CliRunner().invoke(app, ["plan", str(spec), "--out", str(tmp_path / "plan")])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "plan" / "plan.json").read_text())["checkpoint_interval"]
    assert written["rate"]["source"] == "mttf_hours"
    assert [tier["tier"] for tier in written["tiers"]] == ["in-memory copies", "storage"]
