"""A checkpoint written before optimizer state was keyed by parameter name (torch's list-keyed layout) still
loads, with its optimizer state; new checkpoints are keyed by name."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.unit.checkpoints import tiny_model
from training.checkpoint import CheckpointManager, step_dir_name
from training.config import CheckpointConfig
from training.storage import StorageConfig


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(url=str(root)), StorageConfig())


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = tiny_model()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer


def test_a_list_keyed_checkpoint_of_an_earlier_version_loads_with_its_optimizer_state(tmp_path: Path) -> None:
    model, optimizer = _trained()
    manager = _manager(tmp_path)
    manager.save(1, model, optimizer, {"step": 1})
    folder = tmp_path / step_dir_name(1)
    new_keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert "optim.param_groups.0.lr" not in new_keys  # keyed by parameter name now
    # Rewrite its DCP files as an earlier version did (list-keyed), then re-commit them.
    for stale in folder.glob("*.distcp"):
        stale.unlink()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(str(folder)))
    assert "optim.param_groups.0.lr" in dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    from tests.unit.test_checkpoint_trust import _recommit  # noqa: PLC0415 - the trust tests' re-commit helper

    _recommit(folder)

    fresh, fresh_optimizer = tiny_model()
    restored = _manager(tmp_path).load_latest(fresh, fresh_optimizer)
    assert restored is not None and restored.step == 1
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    state_a, state_b = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key]["exp_avg"], state_b[key]["exp_avg"])
