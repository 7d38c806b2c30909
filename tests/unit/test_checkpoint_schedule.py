"""Which steps save to storage (training/checkpoint/save_auto.py): a number, None, and auto with and without a
failure rate; auto's interval is Daly's optimum of the medians of what the saves measured."""

from __future__ import annotations

from training.checkpoint.save_auto import FIRST_SAVE_STEP, SaveSchedule
from training.config import CheckpointConfig


def _due(schedule: SaveSchedule, last: int) -> list[int]:
    return [s for s in range(1, last + 1) if schedule.due(s)]


def test_save_every_steps_is_auto_by_default_and_saves_like_none_without_a_failure_rate() -> None:
    config = CheckpointConfig(url="/tmp/ck")
    assert config.save_every_steps == "auto" and config.mtbf_s is None
    assert _due(SaveSchedule(config.save_every_steps, config.mtbf_s), 100) == []
    assert _due(SaveSchedule(None), 100) == []


def test_a_number_saves_every_that_many_steps_whatever_the_failure_rate() -> None:
    schedule = SaveSchedule(25, mtbf_s=10.0)
    assert _due(schedule, 100) == [25, 50, 75, 100]
    assert schedule.saved(25, stall_s=5.0, step_s=1.0) == 25


def test_auto_saves_first_after_first_save_step_then_at_daly_s_optimum() -> None:
    schedule = SaveSchedule("auto", mtbf_s=3600.0)
    assert _due(schedule, FIRST_SAVE_STEP) == [FIRST_SAVE_STEP]
    # stall 2 s, step 0.5 s, MTBF 1 h: Daly's 118.67 s of training = 237 steps (tests/unit/test_checkpoint_interval)
    assert schedule.saved(FIRST_SAVE_STEP, stall_s=2.0, step_s=0.5) == 237
    assert not schedule.due(FIRST_SAVE_STEP + 236) and schedule.due(FIRST_SAVE_STEP + 237)


def test_auto_chooses_from_the_medians_so_one_slow_save_does_not_move_it() -> None:
    schedule = SaveSchedule("auto", mtbf_s=3600.0)
    schedule.saved(10, stall_s=2.0, step_s=0.5)
    schedule.saved(247, stall_s=2.0, step_s=0.5)
    assert schedule.saved(484, stall_s=50.0, step_s=0.5) == 237  # the median stall is still 2 s


def test_auto_counts_its_first_save_from_the_resumed_step() -> None:
    schedule = SaveSchedule("auto", mtbf_s=3600.0)
    schedule.last_saved = 500
    assert _due(schedule, 500 + FIRST_SAVE_STEP) == [500 + FIRST_SAVE_STEP]
