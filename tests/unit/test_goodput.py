"""Goodput over synthetic records: each badput kind attributed as worked out by hand, the parts summing to the
allocation, and records that overlap refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from validation.goodput import (
    BADPUT_KINDS,
    AttemptTiming,
    Goodput,
    GoodputError,
    GoodputInputs,
    StepTiming,
    goodput_of,
)

T0 = 1_000_000.0
Case = Callable[[], tuple[GoodputInputs, float, dict[str, float]]]


def _steps(first: int, last: int, start: float, step_s: float = 1.0, wait_s: float = 0.0, gap_s: float = 0.0):
    """Steps first..last back to back from `start` (each `step_s` long, `gap_s` apart)."""
    out, t = [], start
    for step in range(first, last + 1):
        t += step_s
        out.append(StepTiming(step, t, step_s, wait_s))
        t += gap_s
    return out


def _case_clean() -> tuple[GoodputInputs, float, dict[str, float]]:
    # job starts at T0, its process at T0+2, the first step at T0+5: of those 5 s the gate took 1 and the restore 1;
    # 10 steps of 1 s with 0.1 s data wait, 0.5 s between steps; a save after step 5 held training 0.3 s of its
    # gap; 2 s after the last step.
    steps = _steps(1, 10, T0 + 5, wait_s=0.1, gap_s=0.5)
    end = steps[-1].ended_unix_s + 2.0
    inputs = GoodputInputs(T0, end, [AttemptTiming(T0 + 2, restore_s=1.0, health_gate_s=1.0)], steps,
                           save_stalls_s=[(5, 0.3)], queue_s=7.0)  # fmt: skip
    expected = {"queue": 7.0, "startup": 3.0, "health_gate": 1.0, "checkpoint_restore": 1.0, "data_wait": 1.0,
                "checkpoint_save": 0.3, "other": 9 * 0.5 - 0.3 + 2.0}  # fmt: skip
    return inputs, 9.0, expected


def _case_kill_and_redo() -> tuple[GoodputInputs, float, dict[str, float]]:
    # attempt 0: steps 1-8 (1 s each, back to back from T0+2); saved after step 5 (0.5 s stall, in the gap);
    # killed while holding after step 8, which hung for 3 s of the 6 s until the restart at T0+17.
    first = _steps(1, 5, T0 + 2)
    resumed_at = first[-1].ended_unix_s + 0.5  # the save's gap
    first += _steps(6, 8, resumed_at)
    restart = first[-1].ended_unix_s + 6.0
    # attempt 1: 2 s start-up, of it 0.5 s restore from step 5; steps 6-10 again; 1 s tail.
    second = _steps(6, 10, restart + 2.0)
    end = second[-1].ended_unix_s + 1.0
    attempts = [AttemptTiming(T0 + 1, hang_s=3.0), AttemptTiming(restart, restore_s=0.5)]
    inputs = GoodputInputs(T0, end, attempts, first + second, save_stalls_s=[(5, 0.5)])
    expected = {"startup": 2.0 + 1.5, "checkpoint_save": 0.5, "redone_steps": 3.0, "hang": 3.0, "recovery": 3.0,
                "checkpoint_restore": 0.5, "other": 1.0}  # fmt: skip
    return inputs, 10.0, expected


def _case_failed_start() -> tuple[GoodputInputs, float, dict[str, float]]:
    # attempt 0 dies before its first step (4 s, a failed start: recovery), attempt 1 trains 3 steps, no tail.
    steps = _steps(1, 3, T0 + 6)
    inputs = GoodputInputs(T0, steps[-1].ended_unix_s, [AttemptTiming(T0), AttemptTiming(T0 + 4)], steps)
    return inputs, 3.0, {"recovery": 4.0, "startup": 2.0}


def _case_memory_copies() -> tuple[GoodputInputs, float, dict[str, float]]:
    # 6 steps of 1 s, 0.5 s apart; an in-memory copy held training 0.2 s before steps 3 and 6 (their records say
    # so) and a storage save 0.1 s after step 5: the gap before step 6 holds both; no tail.
    steps = _steps(1, 6, T0, gap_s=0.5)
    steps = [dataclasses.replace(s, copy_before_s=0.2) if s.step in (3, 6) else s for s in steps]
    inputs = GoodputInputs(T0, steps[-1].ended_unix_s, [AttemptTiming(T0)], steps, save_stalls_s=[(5, 0.1)])
    return inputs, 6.0, {"checkpoint_save": 0.5, "other": 5 * 0.5 - 0.5}


CASES = [_case_clean, _case_kill_and_redo, _case_failed_start, _case_memory_copies]


@pytest.mark.parametrize("case", CASES)
def test_each_badput_kind_gets_its_hand_worked_seconds_and_the_parts_sum_to_the_allocation(case: Case) -> None:
    inputs, productive, expected = case()
    result = goodput_of(inputs)
    allocation = inputs.queue_s + inputs.ended_unix_s - inputs.started_unix_s
    assert result.allocation_s == pytest.approx(allocation)
    assert result.productive_s == pytest.approx(productive)
    assert result.badput_s == pytest.approx({k: expected.get(k, 0.0) for k in BADPUT_KINDS})
    assert result.productive_s + sum(result.badput_s.values()) == pytest.approx(allocation, rel=0.01)
    assert result.goodput == pytest.approx(productive / allocation)


def test_every_kind_is_attributed_by_one_of_the_cases() -> None:
    attributed = set()
    for case in CASES:
        attributed |= {k for k, v in goodput_of(case()[0]).badput_s.items() if v > 0}
    assert attributed == set(BADPUT_KINDS)


def test_records_that_overlap_are_refused_rather_than_counted_twice() -> None:
    # two records of different steps in the same second (clocks of two hosts, or a wrong record): 2 s of steps in
    # a 1 s allocation
    steps = [StepTiming(1, T0 + 1, 1.0), StepTiming(2, T0 + 1, 1.0)]
    with pytest.raises(GoodputError, match="differs from the allocation"):
        goodput_of(GoodputInputs(T0, T0 + 1, [AttemptTiming(T0)], steps))


def test_the_json_form_reads_back_and_the_line_names_the_largest_badput() -> None:
    result = goodput_of(_case_kill_and_redo()[0])
    assert Goodput.from_json(result.to_json()).to_json() == result.to_json()
    line = result.describe()
    assert line.startswith(f"goodput {100 * result.goodput:.1f}% of {result.allocation_s:.1f}s; badput: startup")
    with pytest.raises(GoodputError, match="unknown kinds"):
        Goodput(1.0, 1.0, {"coffee": 0.0})
