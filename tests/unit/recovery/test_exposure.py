"""The deployment's observed failure rate (tasks/recovery/exposure.py): the ledger's failures per node-hour, else
cluster.mttf_hours, else unknown with what to set; and the job step hands it to the trainer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.launch.step import JobInputs
from tasks.recovery.exposure import JobExposure, failure_rate, read_exposures, record_exposure
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge


def _job(nodes: int, hours: float, failures: int) -> JobExposure:
    return JobExposure(job="local:1", nodes=nodes, wall_s=hours * 3600, failures=failures, ended_unix_s=1.0)


def test_observed_failures_give_node_hours_per_failure_divided_by_the_job_s_nodes() -> None:
    # 2 nodes x 10 h + 4 nodes x 5 h = 40 node-hours, 4 failures: 10 h per node; a 4-node job fails every 2.5 h
    rate = failure_rate([_job(2, 10, 1), _job(4, 5, 3)], nodes=4, mttf_hours=1000.0)
    assert rate.source == "ledger" and rate.mtbf_s == pytest.approx(2.5 * 3600)


def test_without_observed_failures_mttf_hours_over_the_nodes_serves() -> None:
    rate = failure_rate([_job(2, 10, 0)], nodes=8, mttf_hours=800.0)
    assert rate.source == "mttf_hours" and rate.mtbf_s == pytest.approx(100 * 3600)
    assert "no failure in 20 node-hours" in rate.detail


def test_neither_is_unknown_and_says_what_to_set() -> None:
    rate = failure_rate([], nodes=2, mttf_hours=None)
    assert rate.mtbf_s is None and rate.source == "unknown"
    assert "cluster.mttf_hours" in rate.describe()


def test_exposures_are_recorded_and_read_back_and_a_stray_file_is_skipped(tmp_path: Path) -> None:
    url = str(tmp_path / "ledger" / "exposure")
    record_exposure(url, _job(2, 1.5, 1))
    (tmp_path / "ledger" / "exposure" / "20000101T000000Z-aaaaaaaa.json").write_text("{not json")
    assert read_exposures(url) == [_job(2, 1.5, 1)]


def test_the_job_step_gives_the_trainer_mttf_hours_over_the_nodes_unless_the_spec_sets_mtbf(tmp_path: Path) -> None:
    # deployment_dir: its own, empty ledger (no observed failure rate from other runs)
    raw = deep_merge(TINY_SPEC, {"cluster": {"nodes": 2, "mttf_hours": 10.0},
                                 "run": {"output_url": str(tmp_path / "out")},
                                 "checkpoint": {"url": str(tmp_path / "ck")},
                                 "data": {"dataset_url": str(tmp_path)},
                                 "deployment_dir": str(tmp_path)})  # fmt: skip
    spec = parse_spec(raw, "tiny")
    inputs = JobInputs.of(spec, spec.training_config())
    assert inputs.train.checkpoint.mtbf_s == pytest.approx(5 * 3600)
    raw["checkpoint"]["mtbf_s"] = 60.0
    spec = parse_spec(raw, "tiny")
    assert JobInputs.of(spec, spec.training_config()).train.checkpoint.mtbf_s == 60.0
