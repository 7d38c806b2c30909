"""The Prefect task `prepare_data` on a real (temporary) Prefect server: result, artifacts, retry rule."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_prepare_data_task_returns_the_dataset_and_publishes_its_counts(prefect_harness, tmp_path: Path) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from tasks.prepare.config import DataSpec, PrepareConfig
    from tasks.prepare.step import DataInputs, DataResult
    from tasks.prepare.task import prepare_data
    from training.storage import StorageConfig

    cfg = PrepareConfig(
        output_url=str(tmp_path / "datasets"),
        builtin_corpus="python-docs",
        builtin_max_bytes=100_000,
        tokenizer={"kind": "bytes"},
        workers=1,
    )

    @flow
    def prepare_only() -> DataResult:
        storage, reports = StorageConfig(), str(tmp_path)
        inputs = DataInputs(data=DataSpec(prepare=cfg), vocab_size=257, storage=storage, reports_dir=reports)
        return prepare_data(inputs)

    result = prepare_only()
    assert Path(result.dataset_url, "manifest.json").exists() and result.validation["success"]

    async def artifacts() -> list:
        async with get_client() as client:
            return await client.read_artifacts(  # the newest: the session's server holds other tests' too
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prepare-data"])),
                sort=ArtifactSort.CREATED_DESC,
            )

    table = asyncio.run(artifacts())[0]
    assert "documents kept" in str(table.data) and str(result.cleaning["kept"]) in str(table.data)


def test_user_errors_are_not_retried_and_transient_ones_are(prefect_harness, tmp_path: Path) -> None:
    from prefect import flow, task

    from tasks.errors import TransientError, UserError, retry_on_transient

    calls = {"user": 0, "transient": 0}

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_on_transient)
    def flaky(kind: str) -> str:
        calls[kind] += 1
        if kind == "user":
            raise UserError("bad input", "fix it")
        if calls[kind] < 2:
            raise TransientError("endpoint down")
        return "ok"

    @flow
    def run(kind: str) -> str:
        return flaky(kind)

    assert run("transient") == "ok" and calls["transient"] == 2
    with pytest.raises(UserError):
        run("user")
    assert calls["user"] == 1
