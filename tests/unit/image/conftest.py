"""Fixtures for the image step's unit tests: a private copy of the training payload to edit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tasks.image.payload import payload_source


@pytest.fixture
def payload_copy(tmp_path: Path) -> Path:
    """A copy of training/ (no bytecode) that a test may change."""
    target = tmp_path / "src" / "training"
    shutil.copytree(payload_source(), target, ignore=shutil.ignore_patterns("__pycache__"))
    return target
