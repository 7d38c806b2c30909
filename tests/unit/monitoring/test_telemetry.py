"""The training payload's exporter: values over real HTTP, optional libraries, GPU readings, config."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.unit.monitoring.conftest import scrape
from training.config import RunConfig, format_validation_error
from training.goodput import BADPUT_KINDS
from training.run_output import AttemptRecord, CheckpointEvent, RunOutputWriter, StepRecord
from training.storage import StorageConfig
from training.telemetry import (
    EXPORTED_METRICS,
    GOODPUT_METRICS,
    GPU_GAUGES,
    GpuReader,
    Telemetry,
    memory_capacity_bytes,
)

LABELS = (("host", "node7"), ("rank", "3"), ("train_job", "job-42"))
RECORD = StepRecord(
    rank=3,
    step=17,
    epoch=0,
    loss=2.718281828459045,
    tokens_per_s=12345.678,
    tokens_per_s_rank=3086.4195,
    step_time_s=0.4321,
    data_wait_s=0.0123,
    comm_s=0.1011,
    compute_s=0.3187,
    peak_mem_bytes=123_456_789,
    time_unix_s=1_767_000_000.25,
)


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    """An exporter on a free port, with a capacity and a baseline, closed afterwards."""
    exporter = Telemetry(
        0, rank=3, host="node7", train_job="job-42", memory_capacity_bytes=8 * 2**30, baseline_tokens_per_s=15000.0
    )
    yield exporter
    exporter.close()


def test_exported_values_match_the_step_record(telemetry: Telemetry) -> None:
    telemetry.observe(RECORD)
    samples = scrape(telemetry.port)

    expected = {
        "tdeploy_train_step": RECORD.step,
        "tdeploy_train_last_step_timestamp_seconds": RECORD.time_unix_s,
        "tdeploy_train_step_time_seconds": RECORD.step_time_s,
        "tdeploy_train_tokens_per_second": RECORD.tokens_per_s,
        "tdeploy_train_loss": RECORD.loss,
        "tdeploy_train_data_wait_ratio": RECORD.data_wait_s / RECORD.step_time_s,
        "tdeploy_train_communication_ratio": RECORD.comm_s / RECORD.step_time_s,
        "tdeploy_train_peak_memory_bytes": RECORD.peak_mem_bytes,
        "tdeploy_train_memory_capacity_bytes": 8 * 2**30,
        "tdeploy_train_baseline_tokens_per_second": 15000.0,
        "tdeploy_train_nonfinite_loss_steps_total": 0,
    }
    assert {name: samples[name] for name in expected} == {name: {LABELS: value} for name, value in expected.items()}


def test_every_served_series_is_declared_and_only_gpu_ones_are_missing_without_a_gpu(telemetry: Telemetry) -> None:
    telemetry.observe(RECORD)
    served = {name for name in scrape(telemetry.port) if not name.endswith("_created")}
    gpu_metrics = {name for name, _ in GPU_GAUGES.values()}
    assert served == EXPORTED_METRICS - gpu_metrics - GOODPUT_METRICS  # goodput: rank 0 of a run with records


def test_rank_0_serves_the_goodput_and_badput_by_kind_of_its_run_records(tmp_path) -> None:  # noqa: ANN001
    # attempt 0 trains steps 1-3 (1 s each, from t0+2) and is killed; attempt 1 starts at t0+10 and trains 2-4
    t0 = 1_767_000_000.0
    out = RunOutputWriter(str(tmp_path), StorageConfig())
    out.append_attempt(AttemptRecord(0, t0, t0 + 1, 2))
    out.append_attempt(AttemptRecord(1, t0 + 10, t0 + 11, 2))
    for step, ended in [(1, 3), (2, 4), (3, 5), (2, 13), (3, 14), (4, 15)]:
        out.append_metrics(dataclasses.replace(RECORD, rank=0, step=step, time_unix_s=t0 + ended, step_time_s=1.0,
                                               data_wait_s=0.0))  # fmt: skip
    out.append_checkpoint(CheckpointEvent(3, 10.0, 0.5, stall_s=0.25))
    out.close()
    exporter = Telemetry(0, rank=0, host="node7", train_job="job-42", goodput_of=str(tmp_path))
    try:
        samples = scrape(exporter.port)
    finally:
        exporter.close()
    labels = (("host", "node7"), ("rank", "0"), ("train_job", "job-42"))
    badput = {dict(k)["kind"]: v for k, v in samples["tdeploy_badput_seconds"].items()}
    assert set(badput) == set(BADPUT_KINDS)
    # steps 2 and 3 of attempt 0 ran again; 2 s of start-up before each attempt's first step; the save after step 3
    # held 0.25 s, the rest of the 5 s until the restart is recovery
    assert (badput["redone_steps"], badput["startup"], badput["checkpoint_save"]) == (2.0, 4.0, 0.25)
    assert badput["recovery"] == 4.75
    productive = 4.0  # the kept steps: 1 of attempt 0, 2-4 of attempt 1
    assert samples["tdeploy_goodput_ratio"][labels] == pytest.approx(productive / (productive + sum(badput.values())))


def test_later_steps_replace_the_values_and_nonfinite_losses_are_counted(telemetry: Telemetry) -> None:
    telemetry.observe(RECORD)
    telemetry.observe(dataclasses.replace(RECORD, step=18, loss=float("nan")))
    telemetry.observe(dataclasses.replace(RECORD, step=19, loss=float("inf")))
    samples = scrape(telemetry.port)
    assert samples["tdeploy_train_step"][LABELS] == 19
    assert samples["tdeploy_train_loss"][LABELS] == math.inf
    assert samples["tdeploy_train_nonfinite_loss_steps_total"][LABELS] == 2


def test_communication_share_is_not_served_when_the_step_did_not_measure_it() -> None:
    exporter = Telemetry(0, rank=0, host="h", train_job="j")
    try:
        exporter.observe(dataclasses.replace(RECORD, comm_s=None))
        samples = scrape(exporter.port)
    finally:
        exporter.close()
    assert "tdeploy_train_communication_ratio" not in samples
    assert "tdeploy_train_baseline_tokens_per_second" not in samples
    assert samples["tdeploy_train_data_wait_ratio"]


def test_no_endpoint_without_a_metrics_port_and_no_gpu_readings_on_cpu() -> None:
    exporter = Telemetry.for_rank(
        RunConfig(steps=1, output_url="unused"),
        rank=0,
        local_rank=0,
        local_world_size=1,
        host="h",
        device=torch.device("cpu"),
    )
    assert exporter.port is None
    assert exporter.gpu_readings() == {}
    exporter.observe(RECORD)
    exporter.close()


def test_a_busy_port_is_logged_with_the_fix_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="training.telemetry"):
            exporter = Telemetry(port, rank=0, host="h", train_job="j")
        exporter.observe(RECORD)
    assert exporter.port is None
    assert f"cannot listen on port {port}" in caplog.text
    assert "run.metrics_port" in caplog.text


def test_close_stops_the_endpoint(telemetry: Telemetry) -> None:
    port = telemetry.port
    scrape(port)
    telemetry.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


def test_without_prometheus_client_and_pynvml_telemetry_is_a_no_op_said_once() -> None:
    script = textwrap.dedent(
        """
        import json, logging, socket, sys
        sys.modules["prometheus_client"] = None  # `import prometheus_client` now raises ImportError
        sys.modules["pynvml"] = None
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        from training.run_output import StepRecord
        from training.telemetry import Telemetry

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        for _ in range(2):
            exporter = Telemetry(port, rank=0, host="h", train_job="j", memory_capacity_bytes=2**30)
            for step in range(3):
                exporter.observe(StepRecord.from_json(json.loads(sys.argv[1])))
            exporter.close()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            listening = True
        except OSError:
            listening = False
        print(json.dumps({"port": exporter.port, "gpu": exporter.gpu_readings(), "listening": listening}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(RECORD.to_json())], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"port": None, "gpu": {}, "listening": False}
    reasons = [line for line in proc.stderr.splitlines() if "prometheus-client cannot be imported" in line]
    assert len(reasons) == 1, proc.stderr
    assert reasons[0].startswith("WARNING training.telemetry:")


def test_memory_capacity_on_cpu_is_the_hosts_ram_shared_by_its_ranks() -> None:
    one = memory_capacity_bytes(torch.device("cpu"), 1)
    assert 0 < one <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory_capacity_bytes(torch.device("cpu"), 4) == one // 4


@pytest.mark.parametrize("port", [0, 65536])
def test_metrics_port_out_of_range_is_refused_with_the_field_and_value(port: int) -> None:
    with pytest.raises(ValidationError) as err:
        RunConfig(steps=1, output_url="x", metrics_port=port)
    (line,) = format_validation_error(err.value)
    assert line.startswith(f"metrics_port={port}: must be")


# ---- GPU readings ------------------------------------------------------------------------------
# No GPU on CI machines: a stand-in with NVML's call signatures and units (percent, bytes, milliwatts)
# checks the conversions and what reaches the record and the endpoint. Real NVML needs a GPU node.


class _StandInNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, power_supported: bool = True) -> None:
        self.power_supported = power_supported
        self.util_percent = 87
        self.power_calls = 0

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:  # noqa: N802 - NVML's names
        return SimpleNamespace(gpu=self.util_percent, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:  # noqa: N802
        return SimpleNamespace(used=60 * 2**30, total=141 * 2**30, free=81 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:  # noqa: N802
        self.power_calls += 1
        if not self.power_supported:
            raise self.NVMLError("Not Supported")
        return 312_500


def test_gpu_readings_are_converted_to_ratio_bytes_and_watts() -> None:
    assert GpuReader(_StandInNvml(), "gpu0").read() == {
        "gpu_util": 0.87,
        "gpu_mem_bytes": 60 * 2**30,
        "gpu_mem_total_bytes": 141 * 2**30,
        "gpu_power_w": 312.5,
    }


def test_an_unsupported_gpu_reading_is_left_out_and_not_asked_again() -> None:
    nvml = _StandInNvml(power_supported=False)
    reader = GpuReader(nvml, "gpu0")
    assert "gpu_power_w" not in reader.read()
    assert set(reader.read()) == {"gpu_util", "gpu_mem_bytes", "gpu_mem_total_bytes"}
    assert nvml.power_calls == 1


def test_gpu_gauges_are_read_at_scrape_time_and_go_into_the_record() -> None:
    nvml = _StandInNvml()
    exporter = Telemetry(0, rank=3, host="node7", train_job="job-42", gpu=GpuReader(nvml, "gpu0"))
    try:
        assert exporter.gpu_readings()["gpu_util"] == 0.87
        nvml.util_percent = 12  # no step in between: the endpoint still shows the GPU as it is now
        samples = scrape(exporter.port)
    finally:
        exporter.close()
    assert samples["tdeploy_gpu_utilization_ratio"] == {LABELS: 0.12}
    assert samples["tdeploy_gpu_memory_used_bytes"] == {LABELS: 60 * 2**30}
    assert samples["tdeploy_gpu_memory_total_bytes"] == {LABELS: 141 * 2**30}
    assert samples["tdeploy_gpu_power_watts"] == {LABELS: 312.5}
