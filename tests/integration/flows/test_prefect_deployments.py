"""The deployments with a real Prefect server and a process worker: `prefect deploy --all`,
`prefect deployment run ... --watch`, the nightly schedule, artifacts, and the UI in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tasks.launch.torchrun import free_port
from tests.conftest import REPO, TINY_SPEC, deep_merge

pytestmark = pytest.mark.integration

PREFECT = str(Path(sys.executable).with_name("prefect"))


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group we started, then SIGKILL it if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`prefect server start` on a free loopback port with a private home; yields the client environment."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",  # the UI's browser side calls this
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as response:
                if response.read().strip() == b"true":
                    break
        except OSError:
            pass
        assert server.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
        time.sleep(1)
    try:
        yield env
    finally:
        _stop(server)
        log.close()


def _prefect(env: dict[str, str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_deployments_run_through_a_worker_with_schedule_artifacts_and_ui(
    prefect_server, tmp_path, tiny_dataset
) -> None:
    env = prefect_server
    spec = deep_merge(
        TINY_SPEC,
        {
            "name": "deployed",
            "deployment_dir": str(tmp_path),
            "data": {"dataset_url": tiny_dataset},
            "checkpoint": {"url": str(tmp_path / "ckpt")},
            "run": {"steps": 20, "output_url": str(tmp_path / "output")},
            "capacity": {"output_url": str(tmp_path)},
            "image": None,
            "acceptance": {"steps": 40, "save_every_steps": 10, "work_url": str(tmp_path / "acceptance"),
                           "thresholds": {"scaling_efficiency_min": 0.01, "comm_share_max": 1.0, "compute_share_min": 0.02}},
            "drills": {"only": ["corrupt_checkpoint"]},
        },
    )  # fmt: skip
    spec_path = tmp_path / "deployed.yaml"
    spec_path.write_text(yaml.safe_dump(spec))

    created = _prefect(env, "work-pool", "create", "tdeploy-local", "--type", "process")
    assert created.returncode == 0, created.stdout + created.stderr
    deployed = _prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    schedules = _prefect(env, "deployment", "schedule", "ls", "nightly-validation/local")
    assert "0 2 * * *" in schedules.stdout, schedules.stdout

    worker_log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115
    # The worker asks for scheduled runs every 10 s by default; the run is created while it starts, so a 1 s
    # interval picks it up without waiting out the rest of the first interval.
    worker = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "tdeploy-local"],
        env={**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}, cwd=REPO, stdout=worker_log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        ran = _prefect(
            env, "deployment", "run", "deploy-training/local", "--param", f"spec={spec_path}", "--watch",
            "--watch-timeout", "1500", timeout=1600,
        )  # fmt: skip
        assert ran.returncode == 0, (
            ran.stdout[-3000:] + ran.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
        )
    finally:
        _stop(worker)  # workers before the server
        worker_log.close()

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def summary() -> list:
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["deployment-summary"]))
            )

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        artifacts = asyncio.run(summary())
    assert artifacts and "Deployment `deployed`: succeeded" in str(artifacts[0].data)
    assert json.loads((tmp_path / "acceptance" / "latest" / "acceptance.json").read_text())["verdict"] == "passed"

    chromium = shutil.which("chromium")
    assert chromium, "chromium is installed by bash .ci/setup --test"
    ui = env["PREFECT_API_URL"].removesuffix("/api") + f"/artifacts/artifact/{artifacts[0].id}"
    dom = subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=30000", "--dump-dom", ui],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert "node environment checks" in dom.stdout and "checkpoint-restore drills" in dom.stdout, dom.stdout[-2000:]
