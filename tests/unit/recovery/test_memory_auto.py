"""checkpoint.memory_every_steps=auto: the fit of the in-memory tier on a node, the interval chosen from a measured
stall, the config's spellings and the acceptance jobs that pin the tier off."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tasks.acceptance.workspace import variant
from training.checkpoint.memory import MemoryTier
from training.checkpoint.memory_auto import (
    REVIEW_EVERY,
    STALL_GOAL,
    StallWindow,
    TierDecision,
    available_bytes,
    choose_interval,
    fit,
    record_decision,
    tier_bytes_per_node,
    tier_decisions,
)
from training.config import CheckpointConfig

MIB = 2**20


@pytest.mark.parametrize(
    ("stall_ms", "step_ms", "most", "interval"),
    [
        (0.5, 20.0, None, 1),  # 2.5% of a step: every step
        (1.0, 20.0, None, 1),  # exactly 5%: every step
        (3.8, 20.0, None, 4),  # 19% of a step: 4 steps keep it at 4.75%
        (4.0, 20.0, None, 4),  # 20%: 4 steps, exactly 5%
        (4.1, 20.0, None, 5),
        (400.0, 20.0, 10, 10),  # bounded by save_every_steps: storage is as fresh beyond it
        (1.0, 0.0, None, 1),  # no step measured yet: every step
    ],
)
def test_the_interval_is_the_smallest_that_keeps_the_stall_per_step_within_the_goal(
    stall_ms: float, step_ms: float, most: int | None, interval: int
) -> None:
    chosen = choose_interval(stall_ms / 1e3, step_ms / 1e3, most)
    assert chosen == interval
    if step_ms and most is None:
        assert stall_ms / chosen <= STALL_GOAL * step_ms + 1e-12
        assert chosen == 1 or stall_ms / (chosen - 1) > STALL_GOAL * step_ms


def test_the_window_chooses_from_medians_so_one_slow_snapshot_does_not_move_the_interval() -> None:
    window = StallWindow()
    # the first snapshots: a 500 ms stall and two warm-up steps of 80 ms among them
    for stall, step in [(0.0005, None), (0.0005, 0.08), (0.5, 0.08), (0.0005, 0.02), (0.0005, 0.02)]:
        window.add(stall, step)
        assert not window.due()
    window.add(0.0005, 0.02)
    assert window.due()
    assert window.proposal(most=None) == 1  # the outliers are the minority of six
    assert not window.due()  # the next choice waits for more snapshots
    for _ in range(REVIEW_EVERY - 1):
        window.add(0.004, 0.02)
        assert not window.due()
    window.add(0.004, 0.02)
    assert window.due() and window.proposal(most=None) == 4


def test_the_tier_fits_when_own_and_peer_copies_of_every_rank_of_the_node_fit_the_budget() -> None:
    # 2 kept steps x (own + peer) x 4 ranks x 1 MiB = 16 MiB
    assert tier_bytes_per_node(MIB, 4) == 16 * MIB
    assert fit(MIB, 4, 16.0, (0, "unused")).fits
    tight = fit(MIB, 4, 15.0, (0, "unused"))
    assert not tight.fits
    assert "16.0 MiB per node" in tight.reason and "checkpoint.memory_budget_mib=15" in tight.reason
    # without a budget: half of what the node has at start
    assert fit(MIB, 4, None, (32 * MIB, "MemAvailable")).fits
    short = fit(MIB, 4, None, (31 * MIB, "MemAvailable"))
    assert not short.fits and "50% of 31 MiB: MemAvailable at start" in short.reason


def test_the_available_figure_is_bounded_by_the_free_space_of_the_copies_folder(tmp_path: Path) -> None:
    free, where = available_bytes(str(tmp_path / "not" / "yet" / "made"))
    assert free > 0 and (where == "MemAvailable" or where == f"free space of {tmp_path}")


def test_decisions_are_recorded_and_read_back_and_a_bad_line_is_named(tmp_path: Path) -> None:
    decision = TierDecision(1, True, 1, 4e6, 8e9, 1e6, reason="")
    record_decision(str(tmp_path), None, decision)
    record_decision(str(tmp_path), None, TierDecision(5, True, 3, 4e6, 8e9, 1e6, 0.003, 0.02))
    assert tier_decisions(str(tmp_path))[0] == decision
    assert tier_decisions(str(tmp_path))[1].interval == 3
    with open(tmp_path / "memory_tier.jsonl", "a") as out:
        out.write('{"step": 1}\n')
    with pytest.raises(ValueError, match="memory_tier.jsonl line 3"):
        tier_decisions(str(tmp_path))


@pytest.mark.parametrize(("value", "on"), [("auto", True), (3, True), (0, False), (None, False)])
def test_memory_every_steps_takes_auto_an_interval_or_off(value: Any, on: bool) -> None:
    cfg = CheckpointConfig(url="/tmp/c", memory_every_steps=value)
    assert cfg.memory_tier_on is on


def test_memory_every_steps_is_auto_unless_set_and_refuses_other_words() -> None:
    assert CheckpointConfig(url="/tmp/c").memory_every_steps == "auto"
    for bad in ("sometimes", -1):
        with pytest.raises(ValidationError, match="memory_every_steps"):
            CheckpointConfig(url="/tmp/c", memory_every_steps=bad)


def test_acceptance_jobs_pin_the_tier_off_unless_a_drill_sets_it(make_spec, tmp_path: Path) -> None:
    train = make_spec({"checkpoint": {"memory_every_steps": "auto"}}).training_config()
    assert variant(train, tmp_path, "plain").checkpoint.memory_every_steps == 0
    drilled = variant(train, tmp_path, "memory", checkpoint={"memory_every_steps": 1})
    assert drilled.checkpoint.memory_every_steps == 1


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_tier_that_does_not_fit_its_budget_takes_no_copy_and_records_why(tmp_path: Path) -> None:
    decisions: list[TierDecision] = []
    cfg = CheckpointConfig(url="/ckpt/job", memory_dir=str(tmp_path), memory_budget_mib=0.01)
    tier = MemoryTier(cfg, "", True, 1, 0, decisions.append)
    model, optimizer = _trained()
    assert tier.due(1)  # auto decides at the first step
    assert tier.snapshot(1, model, optimizer, {"step": 1}) == 0.0
    tier.wait()
    assert not list(tmp_path.rglob("*.pt"))
    assert not any(tier.due(step) for step in range(2, 20))
    (decision,) = decisions
    assert not decision.fits and decision.interval is None
    assert decision.state_bytes >= (64 * 64 + 64 + 64 * 2 + 2) * 4 * 3  # weights and two AdamW moments
    assert "checkpoint.memory_budget_mib=0.01" in decision.reason


def test_a_tier_that_fits_copies_every_step_then_at_the_interval_its_measured_stall_calls_for(tmp_path: Path) -> None:
    decisions: list[TierDecision] = []
    cfg = CheckpointConfig(url="/ckpt/job", memory_dir=str(tmp_path), save_every_steps=50)
    tier = MemoryTier(cfg, "", True, 1, 0, decisions.append)
    model, optimizer = _trained()
    step = 0
    while len(decisions) < 2:
        step += 1
        assert step < 100, decisions
        if tier.due(step):
            tier.snapshot(step, model, optimizer, {"step": step})
        time.sleep(0.002)  # a "step" of about 2 ms: whatever the stall, the choice must follow from the figures
    first, chosen = decisions
    assert first.fits and first.interval == 1 and first.step == 1
    assert chosen.stall_s is not None and chosen.step_s is not None
    assert chosen.interval == choose_interval(chosen.stall_s, chosen.step_s, 50)
    assert [tier.due(s) for s in range(step + 1, step + 3 * chosen.interval + 1)].count(True) == 3
    tier.discard()
