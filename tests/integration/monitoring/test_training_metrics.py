"""A real 2-rank torchrun job serves per-rank metrics while it trains, and trains without the metrics libraries."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tasks.launch.local import run_local, start_local
from tests.conftest import metrics_by_step
from tests.faults.job import injected
from tests.integration.monitoring.conftest import port_is_closed, scrape_until
from training.run_output import RunOutput
from training.telemetry import memory_capacity_bytes

pytestmark = pytest.mark.integration

PAUSE_AFTER_STEP = 3


def test_a_two_rank_run_serves_each_ranks_step_record_on_its_own_port(
    make_spec, metrics_ports: Callable[[int], int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    base = metrics_ports(2)
    spec = make_spec({"run": {"steps": 20, "metrics_port": base, "throughput_baseline_tokens_per_s": 5000.0}})
    job = start_local(
        spec.cluster, spec.training_config(), environment=injected(pause_after_step=PAUSE_AFTER_STEP)
    )
    try:
        scraped = {
            rank: scrape_until(
                base + rank,
                lambda s: s.get("tdeploy_train_step") and list(s["tdeploy_train_step"].values()) == [PAUSE_AFTER_STEP],
                f"rank {rank} at step {PAUSE_AFTER_STEP}",
            )
            for rank in (0, 1)
        }
    finally:
        job.cancel()

    capacity = memory_capacity_bytes(torch.device("cpu"), 2)
    for rank, samples in scraped.items():
        record = metrics_by_step(spec.run.output_url, rank)[PAUSE_AFTER_STEP]
        labels = (("host", socket.gethostname()), ("rank", str(rank)), ("train_job", job.handle.job_id))
        expected = {
            "tdeploy_train_step": record.step,
            "tdeploy_train_last_step_timestamp_seconds": record.time_unix_s,
            "tdeploy_train_step_time_seconds": record.step_time_s,
            "tdeploy_train_tokens_per_second": record.tokens_per_s,
            "tdeploy_train_loss": record.loss,
            "tdeploy_train_data_wait_ratio": record.data_wait_s / record.step_time_s,
            "tdeploy_train_communication_ratio": record.comm_s / record.step_time_s,
            "tdeploy_train_peak_memory_bytes": record.peak_mem_bytes,
            "tdeploy_train_memory_capacity_bytes": capacity,
            "tdeploy_train_baseline_tokens_per_second": 5000.0,
            "tdeploy_train_nonfinite_loss_steps_total": 0,
        }
        assert {name: samples[name] for name in expected} == {name: {labels: v} for name, v in expected.items()}
        gpu = (record.gpu_util, record.gpu_mem_bytes, record.gpu_mem_total_bytes, record.gpu_power_w)
        assert gpu == (None, None, None, None)  # no GPU here: no GPU readings in the record
    assert port_is_closed(base) and port_is_closed(base + 1)  # the job is gone, and its endpoints with it


def test_training_runs_without_prometheus_client_and_pynvml_and_says_why_once_per_rank(
    make_spec, metrics_ports: Callable[[int], int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    # Loaded by every Python process at start-up (torchrun and its workers): both imports raise ImportError.
    (blocker / "sitecustomize.py").write_text(
        'import sys\nsys.modules["prometheus_client"] = None\nsys.modules["pynvml"] = None\n'
    )
    path = os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH")) if p)
    base = metrics_ports(2)
    spec = make_spec({"run": {"steps": 4, "metrics_port": base}, "checkpoint": {"save_at_end": False}})

    monkeypatch.setenv("PYTHONPATH", path)
    job = run_local(spec.cluster, spec.training_config())

    result = json.loads((job.output_dir / "result.json").read_text())
    assert result["steps"] == 4
    for rank in (0, 1):
        assert [r.step for r in RunOutput(job.output_dir).metric_records(rank)] == [1, 2, 3, 4]
    reasons = [line for line in job.log_path.read_text().splitlines() if "prometheus-client cannot be imported" in line]
    assert len(reasons) == 2, reasons  # once on each rank
    assert all("No module named" in line or "halted" in line for line in reasons)
