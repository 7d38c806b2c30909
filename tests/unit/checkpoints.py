"""A tiny model, its optimizer and a checkpoint manager on local disk, for the checkpoint unit tests."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from training.checkpoint import KEY_ENV, CheckpointManager
from training.config import CheckpointConfig
from training.storage import StorageConfig


@pytest.fixture(autouse=True)
def no_key_and_quiet_dcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """No signing key from the caller's environment; DCP's single-process warning silenced."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A linear layer and an AdamW that has taken one step (so it has state to save)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def manager_at(root: Path) -> CheckpointManager:
    """A manager keeping the last 5 checkpoints under `root`."""
    return CheckpointManager(CheckpointConfig(url=str(root), keep_last=5), StorageConfig())


def saved_steps(root: Path, *steps: int) -> CheckpointManager:
    """Save the tiny model at each of `steps` under `root`; the manager that saved them."""
    model, optimizer = tiny_model()
    manager = manager_at(root)
    for step in steps:
        manager.save(step, model, optimizer, {"step": step})
    return manager
