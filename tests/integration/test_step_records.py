"""Both trainers write the one per-step record: the distributed trainer (training/train.py, here as one plain
process) and the independent reference (training/reference.py) write lines with exactly StepRecord's fields, which
the reader gives back whole."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.spec import DeploymentSpec
from tests.conftest import run_lone_process
from training.config import TrainConfig
from training.reference import run_reference
from training.run_output import METRICS_DIR, RunOutput, StepRecord, rank_file

pytestmark = pytest.mark.integration

FIELDS = {f.name for f in dataclasses.fields(StepRecord)}


def _lines(output_dir: str) -> list[dict]:
    path = Path(output_dir) / METRICS_DIR / rank_file(0)
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_trainer_and_the_reference_write_the_same_step_record(make_spec: Callable[..., DeploymentSpec]) -> None:
    overrides = {"run": {"steps": 3, "log_every_steps": 1}, "checkpoint": {"save_every_steps": None}}
    trained = make_spec(overrides, name="trainer")
    run_lone_process(trained)
    cfg = make_spec(overrides, name="reference").training_config()
    run_reference(TrainConfig.model_validate({**cfg.model_dump(), "reference": {"world_size": 1}}))

    for output_dir in (trained.training_config().run.output_url, cfg.run.output_url):
        lines = _lines(output_dir)
        assert [line["step"] for line in lines] == [1, 2, 3]
        assert all(set(line) == FIELDS for line in lines), output_dir
        records = RunOutput(output_dir).metric_records(0)
        assert [r.to_json() for r in records] == lines
        assert all(r.loss > 0 and r.step_time_s and r.tokens_per_s for r in records)
    reference = RunOutput(cfg.run.output_url).metric_records(0)
    assert all(r.twin_loss is not None for r in reference)  # the reference's own figures, in the same record
