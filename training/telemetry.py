"""Live metrics of the training payload for Prometheus, and GPU readings from NVML.

With `run.metrics_port` set, every rank serves its own `/metrics` on
`metrics_port + local_rank`, each series labelled `rank`, `host` and
`train_job` (not `job`: Prometheus sets `job` itself on every scraped target).
The per-step gauges are the values of the rank's last metrics record; GPU
figures are read from NVML at scrape time, so they stay current while the loop
is stuck. Ratios are in 0..1.

Both libraries are optional (the payload depends on torch, numpy, fsspec and
pydantic only): without prometheus-client there is no endpoint, without
nvidia-ml-py or a GPU there are no GPU readings; each is said once in the log.
GPU readings also go into the metrics JSON lines (`gpu_util` 0..1,
`gpu_mem_bytes`, `gpu_mem_total_bytes`, `gpu_power_w`) whenever NVML can read them.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from training.config import RunConfig
from training.goodput import Goodput, GoodputError, goodput_of_run
from training.storage import is_local, local_path

if TYPE_CHECKING:
    import torch

    from training.run_output import StepRecord

log = logging.getLogger(__name__)

LABELS = ("rank", "host", "train_job")

# name -> (help, value from a step record or None when the record has none)
STEP_GAUGES: dict[str, tuple[str, Callable[[StepRecord], float | None]]] = {
    "tdeploy_train_step": ("Last completed optimizer step.", lambda r: r.step),
    "tdeploy_train_last_step_timestamp_seconds": (
        "Unix time at which the last step ended (no progress: time() minus this grows).",
        lambda r: r.time_unix_s,
    ),
    "tdeploy_train_step_time_seconds": ("Wall time of the last step.", lambda r: r.step_time_s),
    "tdeploy_train_tokens_per_second": (
        "Tokens per second of the whole job in the last step, as this rank timed it.",
        lambda r: r.tokens_per_s,
    ),
    "tdeploy_train_loss": (
        "Training loss of the last step, mean over ranks (NaN or Inf once it diverges).",
        lambda r: r.loss,
    ),
    "tdeploy_train_data_wait_ratio": (
        "Share of the last step spent waiting for the input pipeline (0..1).",
        lambda r: None if r.data_wait_s is None or not r.step_time_s else r.data_wait_s / r.step_time_s,
    ),
    "tdeploy_train_communication_ratio": (
        "Share of the last step with a gradient reduction in flight (0..1; measured under DDP only).",
        lambda r: None if r.comm_s is None or not r.step_time_s else r.comm_s / r.step_time_s,
    ),
    "tdeploy_train_peak_memory_bytes": (
        "Peak memory of this rank: allocated on its GPU, resident set size on CPU.",
        lambda r: r.peak_mem_bytes,
    ),
}
MEMORY_CAPACITY = "tdeploy_train_memory_capacity_bytes"
BASELINE = "tdeploy_train_baseline_tokens_per_second"
NONFINITE_LOSS = "tdeploy_train_nonfinite_loss_steps"  # a counter: exposed with the suffix _total
# record key -> (metric name, help); read from NVML
GPU_GAUGES = {
    "gpu_util": ("tdeploy_gpu_utilization_ratio", "GPU utilisation over NVML's last sample period (0..1)."),
    "gpu_mem_bytes": ("tdeploy_gpu_memory_used_bytes", "GPU memory in use on the device (all processes)."),
    "gpu_mem_total_bytes": ("tdeploy_gpu_memory_total_bytes", "GPU memory of the device."),
    "gpu_power_w": ("tdeploy_gpu_power_watts", "GPU power draw."),
}
GOODPUT_RATIO = "tdeploy_goodput_ratio"
BADPUT_SECONDS = "tdeploy_badput_seconds"
GOODPUT_METRICS = frozenset([GOODPUT_RATIO, BADPUT_SECONDS])
"""Rank 0's, from the run's records (training/goodput.py): the job's goodput so far and its badput by `kind`."""
GOODPUT_MIN_REFRESH_S = 30.0
GOODPUT_COST_SHARE = 0.01
"""The goodput gauges are recomputed from the records at most every GOODPUT_MIN_REFRESH_S, and no more often than
keeps their reading under this share of one core (the records grow with the run)."""
EXPORTED_METRICS = frozenset(
    [*STEP_GAUGES, MEMORY_CAPACITY, BASELINE, f"{NONFINITE_LOSS}_total", *(n for n, _ in GPU_GAUGES.values()),
     *GOODPUT_METRICS]
)  # fmt: skip
"""Every series name the exporter can expose (GPU ones only with NVML; the baseline only when configured)."""


@functools.cache
def _prometheus_client() -> ModuleType | None:
    try:
        import prometheus_client
    except ImportError as err:
        log.warning(
            "run.metrics_port is set but prometheus-client cannot be imported (%s): no metrics endpoint; "
            "pip install prometheus-client in the image to serve them",
            err,
        )
        return None
    return prometheus_client


@functools.cache
def _nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError as err:
        log.info("no GPU readings: nvidia-ml-py cannot be imported (%s); pip install nvidia-ml-py for them", err)
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        log.warning("no GPU readings: NVML does not start (%s); is the NVIDIA driver visible here?", err)
        return None
    return pynvml


class GpuReader:
    """NVML readings of one GPU, as metrics record keys; a reading the device does not support is left out."""

    def __init__(self, nvml: ModuleType, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        self._unsupported: set[str] = set()

    @classmethod
    def open(cls, device: torch.device) -> GpuReader | None:
        """The reader of `device`, or None (said once in the log) when it is no GPU or NVML is unavailable."""
        if device.type != "cuda":
            return None
        nvml = _nvml()
        if nvml is None:
            return None
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            # NVML numbers devices without CUDA_VISIBLE_DEVICES; the UUID names the same one on both sides.
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        except (AttributeError, nvml.NVMLError):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as err:
                log.warning("no GPU readings: NVML cannot find cuda:%d (%s)", index, err)
                return None
        return cls(nvml, handle)

    def _reading(self, key: str, read: Callable[[], float]) -> dict[str, float]:
        if key in self._unsupported:
            return {}
        try:
            return {key: read()}
        except self.nvml.NVMLError as err:
            self._unsupported.add(key)
            log.info("GPU reading %s left out: %s", key, err)
            return {}

    def read(self) -> dict[str, float]:
        """gpu_util (0..1), gpu_mem_bytes, gpu_mem_total_bytes and gpu_power_w, as far as the device tells."""
        nvml, handle = self.nvml, self.handle
        memory: dict[str, Any] = {}

        def mem(field: str) -> float:
            if "info" not in memory:
                memory["info"] = nvml.nvmlDeviceGetMemoryInfo(handle)
            return float(getattr(memory["info"], field))

        return {
            **self._reading("gpu_util", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0),
            **self._reading("gpu_mem_bytes", lambda: mem("used")),
            **self._reading("gpu_mem_total_bytes", lambda: mem("total")),
            **self._reading("gpu_power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
        }


class _GpuCollector:
    """Reads the GPU when Prometheus scrapes, so the figures stay live while training is stuck."""

    def __init__(self, reader: GpuReader, labels: dict[str, str]) -> None:
        self.reader, self.labels = reader, labels

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        readings = self.reader.read()
        for key, (name, doc) in GPU_GAUGES.items():
            if key in readings:
                family = GaugeMetricFamily(name, doc, labels=list(self.labels))
                family.add_metric(list(self.labels.values()), readings[key])
                yield family


class _GoodputCollector:
    """The job's goodput so far from the run folder's records, read at scrape time (throttled, see
    GOODPUT_COST_SHARE); nothing until the records give it."""

    def __init__(self, output_dir: str, labels: dict[str, str]) -> None:
        self.output_dir, self.labels = output_dir, labels
        self._figures: Goodput | None = None
        self._next_s = 0.0

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        now = time.monotonic()
        if now >= self._next_s:
            started = time.perf_counter()
            try:
                self._figures = goodput_of_run(self.output_dir, ended_unix_s=time.time())
            except (GoodputError, OSError, ValueError) as err:  # not yet (no attempt record), or records that overlap
                log.debug("goodput not served: %s", err)
            cost = time.perf_counter() - started
            self._next_s = now + max(GOODPUT_MIN_REFRESH_S, cost / GOODPUT_COST_SHARE)
        if self._figures is None:
            return
        ratio = GaugeMetricFamily(GOODPUT_RATIO, "Share of the job's time so far that became kept training progress "
                                  "(0..1; ml-goodput-measurement's definition).", labels=list(self.labels))  # fmt: skip
        ratio.add_metric(list(self.labels.values()), self._figures.goodput)
        yield ratio
        badput = GaugeMetricFamily(BADPUT_SECONDS, "Seconds of the job so far lost to each kind of badput.",
                                   labels=[*self.labels, "kind"])  # fmt: skip
        for kind, seconds in self._figures.badput_s.items():
            badput.add_metric([*self.labels.values(), kind], seconds)
        yield badput


def memory_capacity_bytes(device: torch.device, local_world_size: int) -> int:
    """Memory one rank may use: its GPU's memory, or the host's (cgroup-limited) RAM shared by the local ranks."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total // max(1, local_world_size)


def train_job_label() -> str:
    """The job's name for the `train_job` label: torchrun's run id, else the Slurm job id, else `local`."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "local"


class Telemetry:
    """One rank's metrics: a Prometheus endpoint on `port` (None = off; 0 = any free port) and GPU readings."""

    def __init__(
        self,
        port: int | None,
        *,
        rank: int,
        host: str,
        train_job: str,
        gpu: GpuReader | None = None,
        memory_capacity_bytes: int | None = None,
        baseline_tokens_per_s: float | None = None,
        goodput_of: str | None = None,
    ) -> None:
        self.labels = {"rank": str(rank), "host": host, "train_job": train_job}
        self.gpu = gpu
        self._server: Any = None
        self._gauges: dict[str, Any] = {}
        self._nonfinite: Any = None
        prom = _prometheus_client() if port is not None else None
        if prom is None:
            return
        registry = prom.CollectorRegistry()
        values = list(self.labels.values())
        for name, (doc, _) in STEP_GAUGES.items():
            self._gauges[name] = prom.Gauge(name, doc, list(LABELS), registry=registry)
        self._nonfinite = prom.Counter(
            NONFINITE_LOSS, "Steps whose loss was NaN or Inf.", list(LABELS), registry=registry
        ).labels(*values)
        if memory_capacity_bytes is not None:
            doc = "Memory this rank may use: its GPU's memory, or the host's RAM divided by the ranks on the host."
            prom.Gauge(MEMORY_CAPACITY, doc, list(LABELS), registry=registry).labels(*values).set(memory_capacity_bytes)
        if baseline_tokens_per_s is not None:
            doc = "Accepted tokens per second of this job (run.throughput_baseline_tokens_per_s)."
            prom.Gauge(BASELINE, doc, list(LABELS), registry=registry).labels(*values).set(baseline_tokens_per_s)
        if self.gpu is not None:
            registry.register(_GpuCollector(self.gpu, self.labels))
        if goodput_of is not None:  # `goodput_of`: the run's local output folder (rank 0 serves the job's goodput)
            registry.register(_GoodputCollector(goodput_of, self.labels))
        try:
            self._server, _ = prom.start_http_server(port, registry=registry)
        except OSError as err:
            # Monitoring must not end a training run; the metrics files still get every step.
            log.error(
                "no metrics endpoint: cannot listen on port %d (%s); free the port or set another "
                "run.metrics_port (each rank uses metrics_port + its local rank)",
                port,
                err,
            )
            return
        log.info("serving Prometheus metrics on :%d/metrics", self.port)

    @classmethod
    def for_rank(
        cls, run: RunConfig, *, rank: int, local_rank: int, local_world_size: int, host: str, device: torch.device
    ) -> Telemetry:
        """The telemetry of one training rank, as `run` asks for it."""
        return cls(
            None if run.metrics_port is None else run.metrics_port + local_rank,
            rank=rank,
            host=host,
            train_job=train_job_label(),
            gpu=GpuReader.open(device),
            memory_capacity_bytes=memory_capacity_bytes(device, local_world_size),
            baseline_tokens_per_s=run.throughput_baseline_tokens_per_s,
            goodput_of=local_path(run.output_url) if rank == 0 and is_local(run.output_url) else None,
        )

    @property
    def port(self) -> int | None:
        """The port the endpoint listens on, or None without an endpoint."""
        return None if self._server is None else self._server.server_port

    def gpu_readings(self) -> dict[str, float]:
        """Keys for the step's metrics record ({} without NVML or GPU)."""
        return self.gpu.read() if self.gpu is not None else {}

    def observe(self, record: StepRecord) -> None:
        """Publish one step's metrics record."""
        if self._server is None:
            return
        values = list(self.labels.values())
        for name, (_, value_of) in STEP_GAUGES.items():
            value = value_of(record)
            if value is not None:
                self._gauges[name].labels(*values).set(value)
        if not math.isfinite(record.loss):
            self._nonfinite.inc()

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
