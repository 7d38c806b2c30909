"""A verified load reads each data file once: its sha256 is checked in the pass that reads it, and a file that fails
leaves the model and optimizer as they were."""

from __future__ import annotations

import builtins
import io
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.unit.checkpoints import manager_at, saved_steps, tiny_model
from tests.unit.checkpoints import no_key_and_quiet_dcp  # noqa: F401 - autouse fixture
from training.checkpoint import step_dir_name
from training.checkpoint.manager import _OPTIONS
from training.checkpoint.reader import CheckpointDigestError
from training.checkpoint.store import dcp_load
from training.checkpoint.trust import SafeLoadPlanner


def _count_data_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every open of a DCP data file for reading, by file name (DCP opens through pathlib, hashing through open)."""
    opened: Counter[str] = Counter()
    real = io.open

    def counting(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith(".distcp") and "r" in mode:
            opened[Path(str(file)).name] += 1
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting)
    monkeypatch.setattr(builtins, "open", counting)
    return opened


def _flip_a_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_verified_load_reads_each_data_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved_steps(tmp_path, 1)
    shards = sorted(p.name for p in (tmp_path / step_dir_name(1)).glob("*.distcp"))
    model, optimizer = tiny_model()
    opened = _count_data_reads(monkeypatch)

    restored = manager_at(tmp_path).load_latest(model, optimizer)

    assert restored is not None and restored.step == 1
    assert shards and dict(opened) == dict.fromkeys(shards, 1)


def test_a_mid_file_corruption_found_while_reading_loads_nothing_and_the_previous_checkpoint_is_used(
    tmp_path: Path,
) -> None:
    saved = saved_steps(tmp_path, 1)
    model, optimizer = tiny_model()
    step_1_weight = model.weight.detach().clone()  # what saved_steps saved
    with torch.no_grad():
        model.weight.add_(1.0)  # the state of step 2 differs from step 1's
    saved.save(2, model, optimizer, {"step": 2})
    shard = sorted((tmp_path / step_dir_name(2)).glob("*.distcp"))[0]
    _flip_a_middle_byte(shard)
    assert saved.sound(2, digests_on_read=True) is not None  # sizes and small files pass: only the read finds it

    fresh = torch.nn.Linear(8, 8)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    restored = manager_at(tmp_path).load_latest(fresh, fresh_optimizer)

    assert restored is not None and restored.step == 1
    assert torch.equal(fresh.weight, step_1_weight)


def test_when_the_only_checkpoint_fails_while_read_the_model_and_optimizer_stay_untouched(tmp_path: Path) -> None:
    saved_steps(tmp_path, 3)
    _flip_a_middle_byte(sorted((tmp_path / step_dir_name(3)).glob("*.distcp"))[0])
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    assert manager_at(tmp_path).load_latest(model, optimizer) is None

    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_the_reader_raises_the_digest_error_before_copying_anything(tmp_path: Path) -> None:
    manager = saved_steps(tmp_path, 1)
    commit = manager.read_commit(1)
    assert commit is not None
    _flip_a_middle_byte(sorted((tmp_path / step_dir_name(1)).glob("*.distcp"))[0])
    model, optimizer = tiny_model()
    with torch.no_grad():
        model.weight.zero_()
    url = manager.step_url(1)
    reader = manager._verifying_reader(url, commit)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    with pytest.raises(CheckpointDigestError, match="fails its sha256 check"):
        dcp_load({"model": model_sd, "optim": optim_sd}, reader, SafeLoadPlanner(url))
    assert torch.count_nonzero(model.weight) == 0


def test_tensors_copied_from_the_held_bytes_match_the_saved_state_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))  # odd sizes: bytes land misaligned
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 7)).sum().backward()
    optimizer.step()
    manager_at(tmp_path).save(1, model, optimizer, {"step": 1})
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)

    assert manager_at(tmp_path).load_latest(fresh, fresh_optimizer) is not None

    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for key, state in saved["state"].items():
        assert all(torch.equal(value, loaded["state"][key][name]) for name, value in state.items())
