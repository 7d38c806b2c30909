"""StepRecord is the one per-step metrics record: what the writer appends is what every reader gets back, a line of
an older run (fields missing, or fields this version does not know) still reads, and a line that is no step record
is refused naming the file and the line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from training.run_output import METRICS_DIR, RunOutput, RunOutputFormatError, RunOutputWriter, StepRecord, rank_file
from training.storage import StorageConfig

FULL = StepRecord(
    rank=1, step=7, epoch=0, loss=2.5, rank_loss=2.4, aux_loss=None, lr=3e-4, grad_norm=1.25, loss_scale=None,
    skipped=False, tokens_per_s=1000.0, tokens_per_s_rank=500.0, step_time_s=0.25, data_wait_s=0.01, comm_s=0.02,
    compute_s=0.2, tokens=256, cpu_s=0.3, compute_cpu_s=0.27, compute_device_s=None, peak_mem_bytes=1 << 20,
    runtime_mem_bytes=1 << 19, dropped_tokens=None, comm_bytes={"dp": 4096.0}, comm_s_per_dim={"dp": 0.02},
    time_unix_s=1_767_000_000.5,
)  # fmt: skip


def test_a_written_record_reads_back_equal_with_every_field(tmp_path: Path) -> None:
    out = RunOutputWriter(str(tmp_path), StorageConfig())
    out.append_metrics(FULL)
    out.append_metrics(dataclasses.replace(FULL, step=8, loss=float("nan")))
    out.close()

    run = RunOutput(tmp_path)
    first, second = run.metric_records(1)
    assert first == FULL and run.metrics(1)[7] == FULL
    assert second.step == 8 and math.isnan(second.loss)
    line = json.loads((tmp_path / METRICS_DIR / rank_file(1)).read_text().splitlines()[0])
    assert line["compute_cpu_s"] == 0.27 and line["rank"] == 1  # the file keeps its keys


def test_a_line_of_an_older_run_reads_with_the_missing_figures_none_and_unknown_ones_ignored(tmp_path: Path) -> None:
    folder = tmp_path / METRICS_DIR
    folder.mkdir()
    old = {"rank": 0, "step": 3, "epoch": 0, "loss": 4.0, "lr": 1e-3, "tokens_per_s": 900.0, "step_time_s": 0.5,
           "data_wait_s": 0.0, "comm_s": None, "compute_s": 0.5, "peak_mem_bytes": 10,
           "a_future_field": [1, 2]}  # fmt: skip
    (folder / rank_file(0)).write_text(json.dumps(old) + "\n")

    [record] = RunOutput(tmp_path).metric_records(0)

    assert record.step == 3 and record.loss == 4.0 and record.step_time_s == 0.5
    assert record.compute_cpu_s is None and record.tokens is None and record.twin_loss is None


def test_a_line_without_a_step_is_refused_naming_the_file_and_the_line(tmp_path: Path) -> None:
    folder = tmp_path / METRICS_DIR
    folder.mkdir()
    path = folder / rank_file(0)
    path.write_text(json.dumps(FULL.to_json() | {"rank": 0}) + "\n" + json.dumps({"loss": 1.0}) + "\n")

    with pytest.raises(RunOutputFormatError) as caught:
        RunOutput(tmp_path).metrics(0)

    assert caught.value.path == path and caught.value.problem.startswith("line 2 is not a step record")
    assert "step" in caught.value.problem
