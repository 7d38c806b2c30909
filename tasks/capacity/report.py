"""Human forms of a capacity plan: a rich table for the terminal and markdown for a Prefect artifact."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tasks.capacity.memory import GIB
from tasks.capacity.params import count_params
from tasks.capacity.plan import CapacityPlan
from tasks.capacity.search import Evaluation, explain_win, ranked


def _gib(nbytes: float) -> str:
    """Bytes as GiB with two decimals: 0.05, 12.34, 1,234.56."""
    return f"{nbytes / GIB:,.2f}"


def _sig(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits in plain notation with thousands separators: 0.0123, 1.23, 1,230."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    rounded = float(f"{value:.{digits}g}")
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:,.{decimals}f}"


def _count(value: float) -> str:
    """A count with thousands separators: 1,234,567."""
    return f"{value:,.0f}"


def memory_rows(ev: Evaluation) -> list[tuple[str, str]]:
    """(component, GiB) rows of one layout's peak."""
    m = ev.memory
    return [
        ("weights", _gib(m.weights)),
        ("gradients", _gib(m.gradients)),
        ("optimizer states", _gib(m.optimizer)),
        ("activations", _gib(m.activations)),
        ("autocast weight copies", _gib(m.weight_copies)),
        ("buffers (DDP buckets, gathered FSDP params, rope)", _gib(m.buffers)),
        ("temporaries", _gib(m.transient)),
        ("fragmentation + framework margin", _gib(m.margin)),
        ("total", _gib(m.total)),
        ("usable (device less headroom)", _gib(ev.usable_bytes)),
    ]


def _summary_lines(plan: CapacityPlan) -> list[str]:
    ev, acc = plan.requested, plan.accelerator
    pc_total = count_params(plan.arch).total
    days = plan.steps * ev.step_seconds / 86400
    return [
        f"{plan.name}: {_count(pc_total)} parameters on {plan.cluster.nodes} x {plan.cluster.procs_per_node} "
        f"{acc.name} ({acc.memory_gib:,.2f} GiB each); {plan.precision.recipe} precision",
        f"layout {ev.layout.describe()}: {'fits' if ev.fits else 'DOES NOT FIT'}, peak at {ev.memory.phase}",
        f"step {_sig(ev.step_seconds)} s (compute {_sig(ev.compute_seconds)} s, exposed communication "
        f"{_sig(ev.comm.exposed_seconds)} s, bubble {_sig(ev.comm.bubble_seconds)} s), MFU {ev.mfu:.1%}; "
        f"{_count(plan.train_tokens)} tokens = {_count(plan.steps)} steps = {_sig(days)} days",
        f"communication/compute ratio {_sig(ev.comm.ratio_to_compute)}; inference KV cache "
        f"{_gib(plan.kv_cache_bytes)} GiB for {ev.layout.micro_batch} x {_count(plan.arch.seq_len)} tokens",
    ]


_FITTING_COLUMNS = ("layout", "GiB per GPU", "step s", "MFU", "why")
_MISSES_COLUMNS = ("layout", "GiB per GPU", "why not")


def _fitting_rows(plan: CapacityPlan) -> list[tuple[str, str, str, str, str]]:
    """The fastest layouts that fit, with why each ranks where it does."""
    rows = []
    for ev, nxt in ranked(plan.search.fitting):
        why = "; ".join(explain_win(ev, nxt))
        rows.append((ev.layout.describe(), _gib(ev.memory.total), _sig(ev.step_seconds), f"{ev.mfu:.1%}", why))
    return rows


def _miss_rows(plan: CapacityPlan) -> list[tuple[str, str, str]]:
    """The nearest layouts that do not fit, with what to attack."""
    return [(ev.layout.describe(), _gib(ev.memory.total), ev.why_not()) for ev in plan.search.rejected[:3]]


def rich_report(plan: CapacityPlan) -> Group:
    """Summary, memory breakdown of the requested layout, the fastest layouts that fit and the nearest misses."""
    memory = Table("component", "GiB per GPU", title="memory of the requested layout", title_justify="left")
    for name, value in memory_rows(plan.requested):
        memory.add_row(name, value, style="bold" if name == "total" else None)
    parts: list[Text | Table] = [Text(line) for line in _summary_lines(plan)]
    parts.append(memory)
    if plan.search.fitting:
        layouts = Table(*_FITTING_COLUMNS, title="layouts that fit, fastest first", title_justify="left")
        for row in _fitting_rows(plan):
            layouts.add_row(*(Text(cell) for cell in row))
        parts.append(layouts)
    else:
        parts.append(Text("no layout fits", style="red"))
    if plan.search.rejected:
        misses = Table(*_MISSES_COLUMNS, title="nearest layouts that do not fit", title_justify="left")
        for layout, gib, why in _miss_rows(plan):
            misses.add_row(Text(layout, style="red"), Text(gib), Text(why))
        parts.append(misses)
    parts.append(
        Text(
            f"searched {_count(plan.search.evaluated)} layouts in {_sig(plan.search.seconds)} s; "
            f"{_count(plan.search.fitting_count)} fit"
        )
    )
    parts += [Text(f"warning: {w}", style="yellow") for w in plan.warnings]
    return Group(*parts)


def _markdown_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)] + [f"| {' | '.join(row)} |" for row in rows]


def markdown_report(plan: CapacityPlan) -> str:
    """The same content as markdown (for a Prefect artifact)."""
    lines = [f"# Capacity plan: {plan.name}", ""] + [f"- {line}" for line in _summary_lines(plan)]
    lines += ["", *_markdown_table(("component", "GiB per GPU"), memory_rows(plan.requested))]
    lines += ["", "## Layouts that fit, fastest first", ""]
    lines += _markdown_table(_FITTING_COLUMNS, _fitting_rows(plan)) if plan.search.fitting else ["No layout fits."]
    if plan.search.rejected:
        lines += ["", "## Nearest layouts that do not fit", "", *_markdown_table(_MISSES_COLUMNS, _miss_rows(plan))]
    lines += [""] + [f"**warning**: {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"


def format_self_check(check: dict[str, Any]) -> str:
    """One line per component of a self-check (see measure.Comparison.as_dict)."""
    predicted, measured = check["predicted_bytes"], check["measured_bytes"]
    lines = [
        f"self-check {check['label']} on {check['device']}: predicted {_gib(check['predicted_peak_bytes'])} GiB, "
        f"measured {_gib(check['measured_peak_bytes'])} GiB, error {check['error_fraction']:+.2%}"
    ]
    lines += [
        f"  {name:12s} predicted {_gib(predicted[name])} GiB  measured {_gib(measured[name])} GiB" for name in predicted
    ]
    return "\n".join(lines)
