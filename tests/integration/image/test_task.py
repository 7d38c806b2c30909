"""The Prefect task `build_image`: a markdown artifact, retries on transient registry errors only; the CLI."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect import flow
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from typer.testing import CliRunner

from flows.cli import app
from tasks.image.build import prepare_inputs
from tasks.image.step import ImageInputs, ImageStepResult
from tasks.image.task import build_image
from tasks.spec import DeploymentSpec, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.integration.image.conftest import image_config

pytestmark = pytest.mark.integration


def make_spec(tmp_path: Path, image: dict[str, Any], scheduler: str = "local") -> DeploymentSpec:
    """The tiny spec with an image section and paths under tmp_path (its dataset folder exists: the preflight of
    every command checks it)."""
    (tmp_path / "data").mkdir(exist_ok=True)
    paths = {
        "cluster": {"scheduler": scheduler},
        "data": {"dataset_url": str(tmp_path / "data")},
        "checkpoint": {"url": str(tmp_path / "ckpt")},
        "run": {"output_url": str(tmp_path / "out")},
        "image": image,
    }
    return parse_spec(deep_merge(TINY_SPEC, paths))


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_task(spec: DeploymentSpec, record_dir: Path) -> tuple[str, int, Any]:
    """Run `build_image` (one retry, no delay) in a flow; returns (final state type, run count, result or error)."""

    @flow
    def image_flow() -> dict[str, Any]:
        step = build_image.with_options(retries=1, retry_delay_seconds=0)
        state = step(ImageInputs.of(spec, str(record_dir)), return_state=True)
        data = state.result(raise_on_failure=False)
        return {
            "state": state.type.value,
            "id": str(state.state_details.task_run_id),
            "data": data.record if isinstance(data, ImageStepResult) else str(data),
        }

    out = image_flow()
    with get_client(sync_client=True) as client:
        run_count = client.read_task_run(UUID(out["id"])).run_count
    return out["state"], run_count, out["data"]


@pytest.mark.usefixtures("prefect_harness")
def test_task_publishes_artifact_and_retries_only_transient_registry_errors(image_store: Path, tmp_path: Path) -> None:
    cfg = image_config(image_store).model_dump()
    state, runs, data = run_task(make_spec(tmp_path, cfg, scheduler="slurm"), tmp_path / "ok")
    assert (state, runs) == ("COMPLETED", 1)
    record = json.loads((tmp_path / "ok" / "image.json").read_text())
    assert data == record and data["status"] in ("built", "cached")
    assert data["tag"] == prepare_inputs(image_config(image_store)).tag
    assert data["labels"]["io.transformer-deploy.payload-sha256"] == data["payload_sha256"]
    artifact = Artifact.get("image-build")
    assert artifact is not None and f"# Training image `{data['tag']}`" in str(artifact.data)
    assert f"**{data['status']}**" in str(artifact.data) and f"`{data['image_id']}`" in str(artifact.data)

    down = {**cfg, "registry_url": f"127.0.0.1:{closed_port()}", "registry_insecure": True}
    state, runs, error = run_task(make_spec(tmp_path, down, scheduler="slurm"), tmp_path / "down")
    assert (state, runs) == ("FAILED", 2), "a registry that does not answer is transient: retried"
    assert "is not reachable or failing" in str(error)

    missing = {**cfg, "base_image": "localhost/tdeploy-test/not-there:1"}
    state, runs, error = run_task(make_spec(tmp_path, missing, scheduler="slurm"), tmp_path / "missing")
    assert (state, runs) == ("FAILED", 1), "a missing base image is a user error: never retried"
    assert "pull_policy=never" in str(error)


def test_cli_builds_or_reports_exactly_why_not(image_store: Path, tmp_path: Path) -> None:
    cfg = image_config(image_store).model_dump()
    spec_file = tmp_path / "spec.json"  # JSON is YAML
    spec_file.write_text(json.dumps(make_spec(tmp_path, cfg, scheduler="slurm").model_dump(mode="json")))
    runner = CliRunner()
    # The first run builds unless an earlier test built this tag already; the second finds it either way.
    for expected in ({"built", "cached"}, {"cached"}):
        out = runner.invoke(app, ["build-image", str(spec_file), "--out", str(tmp_path / "rec")])
        assert out.exit_code == 0, out.output
        record = json.loads((tmp_path / "rec" / "image.json").read_text())
        assert record["status"] in expected and f"{record['status']}: " in out.output
        assert f"image {record['reference']}" in out.output and f"digest {record['digest']}" in out.output
    assert "is already in buildah's local store" in out.output

    missing = {**cfg, "base_image": "localhost/tdeploy-test/not-there:1"}
    spec_file.write_text(json.dumps(make_spec(tmp_path, missing, scheduler="slurm").model_dump(mode="json")))
    out = runner.invoke(app, ["build-image", str(spec_file), "--out", str(tmp_path / "rec")])
    assert (
        out.exit_code == 2 and "build-image failed: image.base_image=localhost/tdeploy-test/not-there:1" in out.output
    )

    spec_file.write_text(json.dumps(make_spec(tmp_path, missing, scheduler="local").model_dump(mode="json")))
    out = runner.invoke(app, ["build-image", str(spec_file), "--out", str(tmp_path / "rec")])
    assert out.exit_code == 0 and "skipped: image.base_image=localhost/tdeploy-test/not-there:1" in out.output
    assert "the local run uses the current environment instead" in out.output
