"""The one number format of every capacity table cell and reason: GiB, seconds, counts."""

from __future__ import annotations

import math

GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes as GiB with two decimals and thousands separators: 0.05, 12.34, 1,234.56."""
    return f"{nbytes / GIB:,.2f}"


def sig(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits in plain notation with thousands separators: 0.0123, 1.23, 1,230."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    rounded = float(f"{value:.{digits}g}")
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:,.{decimals}f}"


def count(value: float) -> str:
    """A count with thousands separators: 1,234,567."""
    return f"{value:,.0f}"
