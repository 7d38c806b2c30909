"""How figures read in the tables people look at: the Prefect table artifacts, summary.md and the terminal.

The one owner of that formatting. A figure's unit comes from its name (`p99_e2e_ms`, `tokens_per_s`, `comm_share`,
`peak_bytes`), so a value shows with its unit and a threshold in the same unit beside it; a nested measurement
becomes a short `name=value unit` text (a per-rank mapping its count and largest value), never JSON cut at the edge.
The machine-readable files keep the numbers; only what people read is formatted here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SCALES: dict[str, tuple[str, str]] = {
    "rouge_l": ("ROUGE-L F1", "(0-1)"),
    "bleu4": ("BLEU-4", "(0-100)"),
    "macro_f1": ("macro F1", "(0-1)"),
}
"""Quality scores by figure name: their label and their scale, shown wherever the score is (they differ: BLEU is
0-100, ROUGE-L F1 0-1)."""

SHARES = ("share", "efficiency", "utilization", "utilisation", "agreement", "error_rate", "greedy_match", "fraction",
          "rel_deviation", "rel_error", "increase", "busy", "sm_active", "mfu", "accuracy", "top1_match")  # fmt: skip
"""Name parts of figures that are fractions of one, shown as percent."""

UNITS: tuple[tuple[str, str, float], ...] = (
    ("tokens_per_cpu_s", "tokens/CPU-s", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("images_per_s", "images/s", 1.0),
    ("_per_s", "/s", 1.0),
    ("_gbps", "GB/s", 1.0),
    ("_ms", "ms", 1.0),
    ("_seconds", "s", 1.0),
    ("_s", "s", 1.0),
    ("_gib", "GiB", 1.0),
    ("_mb", "MB", 1.0),
    ("ratio", "x", 1.0),
    ("_factor", "x", 1.0),
)
"""Name ending -> unit and factor (first match; byte counts and shares are handled apart)."""

PER = ("_per_rank", "_per_dim", "_per_host", "_per_device")
"""Endings of figures given per rank (host, ...): the unit is that of the figure without them."""

MAX_ITEMS = 8
"""Figures a measurement cell shows at most; the rest are counted (the report file has them all)."""
MAX_TEXT = 60
"""Characters of a text value a cell shows."""


def label(name: str) -> str:
    """A figure's name as a table shows it (quality scores by their usual name)."""
    base, bound = _bound(name)
    return f"{SCALES[base][0]}{bound and ' ' + bound}" if base in SCALES else name


def unit_of(name: str) -> tuple[str, float]:
    """The unit a figure named `name` is shown in, and the factor from its value to that unit ("" and 1: none)."""
    base = _bound(name)[0].lower()
    for per in PER:
        base = base.removesuffix(per)
    if base in SCALES:
        return SCALES[base][1], 1.0
    if base.endswith("_bytes") or base == "bytes" or base.startswith("bytes_"):
        return "bytes", 1.0
    for part in SHARES:
        if part in base and "per_s" not in base:
            return "%", 100.0
    for suffix, unit, factor in UNITS:
        if base.endswith(suffix):
            return unit, factor
    return "", 1.0


def value(name: str, raw: Any) -> str:
    """One figure as `number unit` (bytes in MiB or GiB, fractions in percent, None as "-")."""
    if raw is None:
        return "-"
    if isinstance(raw, bool):
        return "yes" if raw else "no"
    if isinstance(raw, str):
        return raw if len(raw) <= MAX_TEXT else raw[: MAX_TEXT - 1] + "…"
    if not isinstance(raw, (int, float)):
        return _nested(name, raw)
    unit, factor = unit_of(name)
    if unit == "bytes":
        return _bytes(raw)
    number = raw * factor
    if isinstance(number, float) and not math.isfinite(number):
        text = "n/a"
    elif isinstance(number, int):
        text = f"{number:,}"
    else:
        text = f"{number:.4g}" if abs(number) < 1000 else f"{number:,.0f}"
    return f"{text}{unit}" if unit in ("x", "%") else f"{text} {unit}" if unit else text


def pair(name: str, raw: Any) -> str:
    """`name=value unit`; a bound (`*_min`, `*_max`) as `name ≥ value unit` or `name ≤ value unit`."""
    base, bound = _bound(name)
    sign = {"min": " ≥ ", "max": " ≤ "}.get(bound, "=")
    return f"{label(base)}{sign}{value(name, raw)}"


def text(figures: Any, limit: int = MAX_ITEMS) -> str:
    """A measurement (a mapping, flattened one level), or one value, as short `name=value unit` text."""
    if not isinstance(figures, Mapping):
        return value("", figures)
    parts = [pair(str(k), v) for k, v in figures.items() if v is not None and v != {} and v != []]
    if len(parts) > limit:
        parts = parts[:limit] + [f"+{len(parts) - limit} more"]
    return "; ".join(parts) or "-"


def _bound(name: str) -> tuple[str, str]:
    for bound in ("min", "max"):
        if name.endswith(f"_{bound}"):
            return name.removesuffix(f"_{bound}"), bound
    return name, ""


def _bytes(raw: float) -> str:
    gib = raw / 2**30
    return f"{gib:.3g} GiB" if abs(gib) >= 1 else f"{raw / 2**20:.3g} MiB"


def _slashed(name: str, raw: Any) -> str:
    """A value inside a nested mapping: a list's items joined by slashes (the commas separate the entries)."""
    return "/".join(value(name, v) for v in raw) if isinstance(raw, (list, tuple)) else value(name, raw)


def _short(raw: Any) -> bool:
    """A value that reads in a few words: a scalar, or a list of up to three scalars."""
    if isinstance(raw, (list, tuple)):
        return len(raw) <= 3 and all(_short(v) and not isinstance(v, (list, tuple)) for v in raw)
    return raw is None or isinstance(raw, (int, float, str, bool))


def _nested(name: str, raw: Any) -> str:
    """A nested value in a few words: a mapping of numbers (per rank, per host) as its count and largest value, a
    short list as its items, anything else as its size."""
    items = list(raw.values()) if isinstance(raw, Mapping) else list(raw) if isinstance(raw, (list, tuple)) else None
    if items is None:
        return type(raw).__name__
    numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if isinstance(raw, Mapping) and len(raw) <= 3 and all(_short(v) for v in items):
        inner = (f"{k}: {_slashed(str(k) if unit_of(str(k))[0] else name, v)}" for k, v in raw.items())
        return "(" + ", ".join(inner) + ")"
    if numbers and len(numbers) == len(items):
        if not isinstance(raw, Mapping) and len(items) <= 3:
            return ", ".join(value(name, v) for v in items)
        return f"{len(items)} values, max {value(name, max(numbers))}"
    if not isinstance(raw, Mapping) and len(items) <= 3 and all(isinstance(v, str) for v in items):
        return ", ".join(items) or "none"
    noun = ("entry" if isinstance(raw, Mapping) else "item") if len(items) == 1 else None
    return f"{len(items)} {noun or ('entries' if isinstance(raw, Mapping) else 'items')}"
