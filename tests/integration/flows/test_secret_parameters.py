"""A credential in a flow's spec parameter never reaches Prefect's database: the run is created with the
parameters redacted, so neither the SQLite file nor its write-ahead log ever holds the secret (a redaction
after the run's creation leaves the first version in the log until a checkpoint, and in freed pages after)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _database_files() -> list[Path]:
    """Prefect's SQLite database of this session's harness and its -wal and -shm files (those that exist)."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    assert url.startswith("sqlite+aiosqlite:///"), url
    database = Path(url.removeprefix("sqlite+aiosqlite:///"))
    return [path for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm")) if path.exists()]


def _drain() -> None:
    """Everything the run sent (logs, events) written by the server before the files are read."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


def test_a_secret_in_the_spec_parameter_is_in_neither_the_database_nor_its_write_ahead_log(
    prefect_harness, tmp_path: Path
) -> None:
    from flows.deploy import deploy_training
    from tests.conftest import TINY_SPEC, deep_merge

    secret = f"hunter2-{uuid.uuid4().hex}"
    paths = {"data": {"dataset_url": str(tmp_path / "d")}, "checkpoint": {"url": str(tmp_path / "c")},
             "run": {"output_url": str(tmp_path / "o")}}  # fmt: skip
    leak = {"storage": {"options": {"client_kwargs": {"aws_secret_access_key": secret}}}}
    state = deploy_training(deep_merge(deep_merge(TINY_SPEC, paths), leak), return_state=True)
    assert state.is_failed()
    _drain()

    files = _database_files()
    assert files and files[0].stat().st_size > 0, files
    assert any(path.name.endswith("-wal") for path in files), "the harness's SQLite runs in WAL mode"
    found = [path.name for path in files if secret.encode() in path.read_bytes()]
    assert found == [], f"the secret is stored in {found}"

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # the rest of the parameter is kept for the record
        stored = client.read_flow_run(state.state_details.flow_run_id).parameters
    assert stored["spec"]["storage"]["options"]["client_kwargs"] == {"aws_secret_access_key": "<redacted>"}
    assert stored["spec"]["model"] == TINY_SPEC["model"]
