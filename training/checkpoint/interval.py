"""The checkpoint interval that loses the least time to saves and to re-done work, from the stall per save and the
job's mean time between failures (pure arithmetic: the payload, the planner and acceptance share it).

Young (1974), "A first order approximation to the optimum checkpoint interval", Commun. ACM 17(9): with a save that
holds training `delta` seconds and failures arriving at mean interval `M`, the time between saves that minimises the
expected waste is `sqrt(2 delta M)`. Daly (2006), "A higher order estimate of the optimum checkpoint interval for
restart dumps", Future Generation Computer Systems 22(3), eq. (37): `sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) +
(1/9) (delta / 2M)] - delta` for `delta < 2M`, else `M` (Young's is its first term). Both give the compute time
between the ends of two saves.

The expected waste of an interval `T` (the share of the allocation that is not kept progress, restart time left
out) is Young's first-order model: `delta / T` spent saving plus, per failure, half an interval and a save re-done,
`(T + delta) / 2M`; the goodput cost of running at another interval than the optimum is the difference.
"""

from __future__ import annotations

import math

__all__ = ["expected_waste", "interval_steps", "young_daly_s", "young_s"]


def young_s(stall_s: float, mtbf_s: float) -> float:
    """Young's optimum, `sqrt(2 stall mtbf)` seconds of training between saves."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def young_daly_s(stall_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (seconds of training between saves): Young's term with Daly's corrections, less
    the stall; the mean time between failures itself once a save costs twice that or more."""
    if stall_s < 0 or mtbf_s <= 0:
        raise ValueError(f"stall_s={stall_s} must be >= 0 and mtbf_s={mtbf_s} > 0")
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = stall_s / (2.0 * mtbf_s)
    return young_s(stall_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - stall_s


def interval_steps(stall_s: float, step_s: float, mtbf_s: float | None, most: int | None = None) -> int | None:
    """Daly's optimum in steps of `step_s` (rounded, at least 1, at most `most`); None when no failure rate is known
    (`mtbf_s` None) or the step time is not (`step_s` <= 0)."""
    if mtbf_s is None or step_s <= 0:
        return None
    steps = max(1, round(young_daly_s(stall_s, mtbf_s) / step_s))
    return steps if most is None else min(steps, most)


def expected_waste(interval_s: float, stall_s: float, mtbf_s: float) -> float:
    """Young's first-order share of the time lost to saves every `interval_s` of training and to the work re-done
    after failures at mean interval `mtbf_s` (at most 1)."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"interval_s={interval_s} and mtbf_s={mtbf_s} must be > 0")
    return min(1.0, stall_s / interval_s + (interval_s + stall_s) / (2.0 * mtbf_s))
