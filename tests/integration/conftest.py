"""Fixtures the integration tests of several files share."""

from __future__ import annotations

import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.launch.conftest import slurm_session
from training.checkpoint import KEY_ENV


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 2 MB tmpfs (needs root, as in CI and the dev container)."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The single-node Slurm test cluster (tests/integration/launch/conftest.py), once per session (per xdist
    worker), for the launcher's tests and the drills through Slurm; yields the client environment."""
    yield from slurm_session(tmp_path_factory)
