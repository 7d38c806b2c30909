"""drills.rto_max_s: a drill that recovered, but slower than the threshold, fails with the figure and the limit."""

from __future__ import annotations

import pytest

from tasks.acceptance.config import DrillConfig
from tasks.acceptance.drill_table import held_to_rto
from tasks.acceptance.record import DrillResult


@pytest.mark.parametrize(
    ("passed", "recovery_s", "limit", "verdict"),
    [
        (True, 12.5, 10.0, False),  # recovered, too slowly
        (True, 9.0, 10.0, True),
        (True, None, 10.0, True),  # no recovery time measured: nothing to judge
        (True, 500.0, None, True),  # the threshold switched off
        (False, 1.0, 10.0, False),  # failed for its own reason: kept as it was
        (None, 50.0, 10.0, None),  # skipped drills stay skipped
    ],
)
def test_a_drill_is_held_to_the_recovery_time_threshold(passed, recovery_s, limit, verdict) -> None:
    result = held_to_rto(DrillResult("memory_restore", passed, recovery_s=recovery_s, message="own"), limit)
    assert result.passed is verdict
    if passed and verdict is False:
        assert result.message.startswith(f"recovery took {recovery_s:.1f} s > drills.rto_max_s={limit:g} s")
    else:
        assert result.message == "own"


def test_the_recovery_time_threshold_has_a_default_and_can_be_switched_off() -> None:
    assert DrillConfig().rto_max_s == 120.0
    assert DrillConfig(rto_max_s=None).rto_max_s is None
    with pytest.raises(ValueError, match="rto_max_s"):
        DrillConfig(rto_max_s=0)
