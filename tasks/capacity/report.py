"""Human forms of a capacity plan: a rich table for the terminal and markdown for a Prefect artifact."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tasks.capacity.memory import GIB
from tasks.capacity.params import count_params
from tasks.capacity.plan import CapacityPlan
from tasks.capacity.search import Evaluation, explain_win, ranked


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g}"


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
        f"{plan.name}: {pc_total:,} parameters on {plan.cluster.nodes} x {plan.cluster.procs_per_node} {acc.name} "
        f"({acc.memory_gib:g} GiB each); {plan.precision.recipe} precision",
        f"layout {ev.layout.describe()}: {'fits' if ev.fits else 'DOES NOT FIT'}, peak at {ev.memory.phase}",
        f"step {ev.step_seconds:.4g} s (compute {ev.compute_seconds:.4g} s, exposed communication "
        f"{ev.comm.exposed_seconds:.4g} s, bubble {ev.comm.bubble_seconds:.4g} s), MFU {ev.mfu:.1%}; "
        f"{plan.train_tokens:.3g} tokens = {plan.steps:,.0f} steps = {days:.3g} days",
        f"communication/compute ratio {ev.comm.ratio_to_compute:.2f}; inference KV cache "
        f"{plan.kv_cache_bytes / GIB:.3g} GiB for {ev.layout.micro_batch} x {plan.arch.seq_len} tokens",
    ]


def rich_report(plan: CapacityPlan) -> Group:
    """Summary, memory breakdown of the requested layout, and the best and nearest-miss layouts."""
    memory = Table("component", "GiB per GPU", title="memory of the requested layout", title_justify="left")
    for name, value in memory_rows(plan.requested):
        memory.add_row(name, value, style="bold" if name == "total" else None)
    layouts = Table(
        "layout", "GiB", "step s", "MFU", "why", title="layouts that fit, fastest first", title_justify="left"
    )
    for ev, nxt in ranked(plan.search.fitting):
        layouts.add_row(
            ev.layout.describe(), _gib(ev.memory.total), f"{ev.step_seconds:.4g}", f"{ev.mfu:.1%}",
            Text("; ".join(explain_win(ev, nxt))),
        )  # fmt: skip
    for ev in plan.search.rejected[:3]:
        layouts.add_row(Text(ev.layout.describe(), style="red"), _gib(ev.memory.total), "-", "-", Text(ev.why_not()))
    parts: list[Text | Table] = [Text(line) for line in _summary_lines(plan)]
    parts += [memory, layouts]
    parts.append(
        Text(
            f"searched {plan.search.evaluated:,} layouts in {plan.search.seconds:.3f} s; "
            f"{plan.search.fitting_count:,} fit"
        )
    )
    parts += [Text(f"warning: {w}", style="yellow") for w in plan.warnings]
    return Group(*parts)


def markdown_report(plan: CapacityPlan) -> str:
    """The same content as markdown (for a Prefect artifact)."""
    lines = [f"# Capacity plan: {plan.name}", ""] + [f"- {line}" for line in _summary_lines(plan)]
    lines += ["", "| component | GiB per GPU |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in memory_rows(plan.requested)]
    lines += ["", "| layout | GiB | step s | MFU | why |", "|---|---|---|---|---|"]
    for ev, nxt in ranked(plan.search.fitting):
        why = "; ".join(explain_win(ev, nxt))
        lines.append(
            f"| {ev.layout.describe()} | {_gib(ev.memory.total)} | {ev.step_seconds:.4g} | {ev.mfu:.1%} | {why} |"
        )
    for ev in plan.search.rejected[:3]:
        lines.append(f"| {ev.layout.describe()} (does not fit) | {_gib(ev.memory.total)} | - | - | {ev.why_not()} |")
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
