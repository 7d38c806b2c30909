"""Shared fixtures: a tiny byte-level dataset, spec factories, run-output readers, and the servers the tests use.

Every server a fixture starts is stopped by the PID or process group it recorded, also when the test or the
fixture's own setup times out or raises; whatever is still recorded at the end of the session (or when pytest
gets SIGTERM) is stopped by tests.processes.stop_all.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.roots import ALLOWED_ROOTS_ENV
from tasks.spec import DeploymentSpec, parse_spec
from tests import processes
from tests.processes import run_group
from training import run_output
from training.network import listen_port
from training.run_output import RunOutput, StepRecord
from training.storage import StorageConfig

REPO = Path(__file__).resolve().parents[1]

# The smallest model that still learns something in a few dozen CPU steps.
TINY_SPEC: dict[str, Any] = {
    "name": "tiny",
    "cluster": {"scheduler": "local", "nodes": 1, "procs_per_node": 2, "accelerator": "cpu"},
    "model": {
        "n_layers": 2,
        "d_model": 32,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_hidden": 64,
        "vocab_size": 257,
        "seq_len": 32,
    },
    "parallel": {"sharding": "ddp", "micro_batch": 4, "grad_accum_steps": 1},
    "precision": {"dtype": "fp32"},
    "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 2, "schedule": "cosine"},
    "data": {"dataset_url": "set-by-fixture"},
    # The in-memory tier off (its default is auto): these tests restore from storage; tests/*/recovery turn it on.
    "checkpoint": {"url": "set-by-fixture", "save_every_steps": 10, "keep_last": 3, "memory_every_steps": 0},
    "run": {"steps": 20, "seed": 7, "output_url": "set-by-fixture", "log_every_steps": 5, "threads_per_rank": 1},
}


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of base with overrides merged in section by section (None deletes a key)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def pytest_configure(config: pytest.Config) -> None:
    """Stop the test session's processes at interpreter exit and on SIGTERM, even if pytest never finishes; the
    operator's roots (tasks/roots.py) of the session: the repository and the temporary folders its tests use
    (os.environ, so every tdeploy, torchrun and flow the tests start inherits them)."""
    processes.install_safety_net()
    roots = [str(REPO), tempfile.gettempdir()]
    if config.option.basetemp:
        roots.append(os.path.abspath(config.option.basetemp))
    os.environ[ALLOWED_ROOTS_ENV] = os.pathsep.join(roots)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop every process group the session started that a fixture or test did not stop itself."""
    left = processes.stop_all()
    if left:  # an xdist worker has no terminal of its own: its stderr reaches the controller's output
        message = f"tests/processes: stopped {len(left)} process(es) that no fixture or test stopped: {left}"
        if session.config.pluginmanager.get_plugin("terminalreporter") is None:
            print(message, file=sys.stderr)
        else:
            writer = session.config.get_terminal_writer()
            writer.line()
            writer.line(message)


@pytest.fixture(autouse=True, scope="session")
def _quiet_cpu_env(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The dataset reader's first-use markers: per test session, not in the user's ~/.cache.
    os.environ.setdefault("TDEPLOY_CACHE_DIR", str(tmp_path_factory.mktemp("tdeploy-cache")))
    # Job records by reference (slurm:2 ...): per test session, not the user's ~/.tdeploy shared by both xdist
    # workers, whose Slurm clusters each number their jobs from 1 (one worker's slurm:2 overwrote the other's).
    os.environ.setdefault("TDEPLOY_HOME", str(tmp_path_factory.mktemp("tdeploy-home")))


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level dataset of about 300 kB of standard-library documentation (suites skipped: fast)."""
    cfg = PrepareConfig(
        output_url=str(tmp_path_factory.mktemp("dataset")),
        builtin_corpus="python-docs",
        builtin_max_bytes=300_000,
        tokenizer={"kind": "bytes"},
        workers=1,
    )
    return prepare_dataset(cfg, StorageConfig(), validate=False).dataset_url


@pytest.fixture
def make_spec(tmp_path: Path, tiny_dataset: str) -> Callable[..., DeploymentSpec]:
    """Build a validated tiny spec; `name` picks a separate output/checkpoint folder under tmp_path."""

    def factory(overrides: dict[str, Any] | None = None, name: str = "run") -> DeploymentSpec:
        paths = {
            "data": {"dataset_url": tiny_dataset},
            "checkpoint": {"url": str(tmp_path / name / "checkpoints")},
            "run": {"output_url": str(tmp_path / name / "output")},
            # the deployment's own folder (its ledger: exposure records, the health gate's baseline), not the
            # shared runs/tiny of the working directory, which other tests' jobs write to
            "deployment_dir": str(tmp_path / name / "deployment"),
        }
        raw = deep_merge(deep_merge(TINY_SPEC, paths), overrides or {})
        if raw["cluster"].get("scheduler") == "slurm":
            # The single-node Slurm test cluster runs its jobs in this machine's network namespace, beside the
            # other pytest worker's jobs: each spec gets a free rendezvous port, not the shared default 29500.
            slurm = dict(raw["cluster"].get("slurm") or {})
            slurm.setdefault("rdzv_port", listen_port())
            raw["cluster"]["slurm"] = slurm
        return parse_spec(raw, f"tiny:{name}")

    return factory


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of a file (which must exist)."""
    assert path.exists(), f"{path} was never written"
    return run_output.read_jsonl(path)


def metrics_by_step(output_dir: str | Path, rank: int = 0) -> dict[int, StepRecord]:
    """Per-step metrics of one rank; when a step ran twice (resume), the later attempt wins."""
    return RunOutput(output_dir).metrics(rank)


def run_lone_process(spec: DeploymentSpec) -> dict[str, Any]:
    """Run the trainer as one plain process (no torchrun); returns its result as a dict."""
    cfg = spec.training_config()
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(out / "run.json")
    proc = run_group([sys.executable, "-m", "training.train", "--config", str(out / "run.json")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = RunOutput(out).result()
    assert result is not None, f"the trainer wrote no result into {out}"
    return asdict(result)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible endpoint (moto's server) on 127.0.0.1, with test credentials in the environment."""
    from moto.server import ThreadedMotoServer

    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    """A fresh bucket on the test endpoint."""
    import boto3

    name = "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A private, temporary Prefect backend for the whole test session (no analytics, private home)."""
    os.environ.update(
        {
            "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home")),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
            "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        }
    )
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.testing.utilities import prefect_test_harness

    # The harness does not stop its server when the start times out or is interrupted (pytest's timeout):
    # record every server process it starts, and stop those here however the fixture ends.
    started: list[subprocess.Popen] = []
    start_server = SubprocessASGIServer._run_uvicorn_command

    def start_tracked(server: SubprocessASGIServer) -> subprocess.Popen:
        proc = processes.track(start_server(server))
        started.append(proc)
        return proc

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SubprocessASGIServer, "_run_uvicorn_command", start_tracked)
        try:
            with prefect_test_harness(server_startup_timeout=180):
                yield
        finally:
            for proc in started:
                processes.stop_process(proc)


def process_running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"
