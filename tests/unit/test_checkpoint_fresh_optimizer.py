"""A resume into a fresh Adam/AdamW gives it its state without DCP's zero-lr step, and training goes on bit for bit."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.unit.checkpoints import manager_at
from tests.unit.checkpoints import no_key_and_quiet_dcp  # noqa: F401 - autouse fixture
from training.checkpoint.optim_state import make_state_to_load

_OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95)),
    "adamw-amsgrad-for-loop": lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, foreach=False),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
}


def _build(seed: int, kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two layers in two parameter groups (decay on matrices only, as the trainer does), one frozen bias."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    model[2].bias.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0},
    ]
    return model, _OPTIMIZERS[kind](groups)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", list(_OPTIMIZERS))
def test_a_fresh_optimizer_is_loaded_without_a_step_and_the_next_step_matches_an_uninterrupted_run(
    tmp_path: Path, kind: str
) -> None:
    model, optimizer = _build(0, kind)
    for i in range(3):
        _step(model, optimizer, i)
    manager_at(tmp_path).save(3, model, optimizer, {"step": 3})
    saved = optimizer.state_dict()
    fresh, fresh_optimizer = _build(1, kind)
    steps_taken: list[int] = []
    fresh_optimizer.register_step_pre_hook(lambda *_: steps_taken.append(1))

    assert manager_at(tmp_path).load_latest(fresh, fresh_optimizer) is not None

    assert steps_taken == [] and gc.isenabled()
    loaded = fresh_optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"] and loaded["state"].keys() == saved["state"].keys()
    for index, state in saved["state"].items():
        assert state.keys() == loaded["state"][index].keys()
        for name, value in state.items():
            got = loaded["state"][index][name]
            assert got.dtype == value.dtype and got.device == value.device and torch.equal(got, value), (index, name)
    _step(model, optimizer, 3)
    _step(fresh, fresh_optimizer, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_other_optimizers_and_ones_with_state_are_left_to_dcp() -> None:
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert not make_state_to_load(sgd) and not sgd.state
    _, adamw = _build(0, "adamw")
    assert make_state_to_load(adamw)
    state = next(iter(adamw.state.values()))
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert not make_state_to_load(adamw)  # it has state now: nothing remade
