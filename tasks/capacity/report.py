"""Human forms of a capacity plan: a rich table for the terminal and markdown for a Prefect artifact."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tasks.capacity.params import count_params
from tasks.capacity.payload import problem_lines
from tasks.capacity.plan import CapacityPlan
from tasks.capacity.search import Evaluation, explain_win, ranked
from tasks.capacity.units import count, gib, sig


def memory_rows(ev: Evaluation) -> list[tuple[str, str]]:
    """(component, GiB) rows of one layout's peak."""
    m = ev.memory
    return [
        ("weights", gib(m.weights)),
        ("gradients", gib(m.gradients)),
        ("optimizer states", gib(m.optimizer)),
        ("activations (alive at the peak moment)", gib(m.activations)),
        ("autocast weight copies", gib(m.weight_copies)),
        ("buffers (DDP buckets, gathered FSDP params, rope)", gib(m.buffers)),
        ("temporaries", gib(m.transient)),
        *_teacher_rows(ev),
        ("fragmentation + framework margin", gib(m.margin)),
        ("total", gib(m.total)),
        ("usable (device less headroom)", gib(ev.usable_bytes)),
    ]


def _teacher_rows(ev: Evaluation) -> list[tuple[str, str]]:
    """distill: the frozen teacher's rows of the peak (none without a teacher)."""
    m = ev.memory
    if not m.teacher_weights:
        return []
    return [
        ("distillation teacher weights (fp32, whole per rank)", gib(m.teacher_weights)),
        ("distillation teacher logits (one micro-batch, fp32)", gib(m.teacher_logits)),
    ]


def _summary_lines(plan: CapacityPlan) -> list[str]:
    ev, acc = plan.requested, plan.accelerator
    pc_total = count_params(plan.arch).total
    days = plan.steps * ev.step_seconds / 86400
    return [
        f"{plan.name}: {count(pc_total)} parameters on {plan.cluster.nodes} x {plan.cluster.procs_per_node} "
        f"{acc.name} ({acc.memory_gib:,.2f} GiB each); {plan.precision.recipe} precision",
        f"layout {ev.layout.describe()}: {'fits' if ev.fits else 'DOES NOT FIT'}, peak at {ev.memory.phase}",
        f"step {sig(ev.step_seconds)} s: {_time_terms(ev)}; MFU {ev.mfu:.1%}, HFU {ev.hfu:.1%}; "
        f"{count(plan.train_tokens)} tokens = {count(plan.steps)} steps = {sig(days)} days",
        f"communication/compute ratio {sig(ev.comm.ratio_to_compute)}; inference KV cache "
        f"{gib(plan.kv_cache_bytes)} GiB for {ev.layout.micro_batch} x {count(plan.arch.seq_len)} tokens",
        f"activations: {gib(ev.memory.activations_stored)} GiB stored for backward (every micro-batch in flight), "
        f"{gib(ev.memory.activations)} GiB alive at the peak ({ev.memory.phase})",
        *_flops_lines(plan),
        *_teacher_lines(plan),
        *_calibration_lines(plan),
        *_stage_lines(plan),
        plan.memory_tier().describe(),
        *_serving_lines(plan),
    ]


def _teacher_lines(plan: CapacityPlan) -> list[str]:
    """distill: the teacher's size, its share of the peak and its forward's share of the step."""
    if plan.teacher is None:
        return []
    t = plan.teacher_json()
    return [
        f"distillation teacher: {count(t['params'])} parameters, weights {gib(t['weights_bytes'])} GiB (fp32, whole "
        f"on every rank), logits {gib(t['logits_bytes'])} GiB, forward working set "
        f"{gib(t['forward_working_set_bytes'])} GiB (transient, no autograd); forward "
        f"{t['forward_flops_per_step']:.4g} FLOPs = {sig(t['forward_seconds'])} s per step"
    ]


def _flops_lines(plan: CapacityPlan) -> list[str]:
    """FLOPs per token under each named convention, and the FLOP budget's time and compute-optimal size."""
    cells = "; ".join(f"{c['name']} {c['per_token_flops']:.4g}" for c in plan.flops_conventions())
    lines = [f"FLOPs per token: {cells}"]
    budget = plan.flop_budget()
    if budget is not None:
        fit = budget["compute_optimal"]["approach_3_fit"]
        rule = budget["compute_optimal"]["twenty_tokens_per_param"]
        lines.append(
            f"budget {budget['flops']:.3g} FLOPs (6ND): {sig(budget['days'])} days here at MFU "
            f"{plan.requested.mfu:.1%}; compute-optimal (Chinchilla) {count(rule['params'])} parameters x "
            f"{count(rule['tokens'])} tokens at 20 tokens per parameter, {count(fit['params'])} x "
            f"{count(fit['tokens'])} by the Approach 3 fit"
        )
    return lines


def _calibration_lines(plan: CapacityPlan) -> list[str]:
    """The measured / planned factors the plan applies, and where they come from (nothing when none)."""
    c = plan.calibration
    if c.source == "none":
        return []
    raw = plan.planned()
    return [
        f"calibrated from {'the ledger' if c.source == 'ledger' else c.source} ({c.runs} runs): step time x"
        f"{sig(c.step_time_scale)} (uncalibrated {sig(raw.step_seconds)} s), memory x{sig(c.memory_scale)}"
    ]


def _serving_lines(plan: CapacityPlan) -> list[str]:
    """The serving plan: memory per GPU and the largest concurrency that fits (nothing without a serve section)."""
    if plan.serving is None:
        return []
    m, st = plan.serving.memory, plan.serving.settings
    return [
        f"serving (vLLM, {st.dtype}, TP {st.tensor_parallel}): weights {gib(m.weights)} GiB, activations "
        f"{gib(m.activations.peak)} GiB, KV cache {gib(m.kv_bytes_per_token * m.context)} GiB per sequence of "
        f"{count(m.context)} tokens; {m.max_concurrency} such sequences fit ({st.max_num_seqs} asked)"
    ]


def _time_terms(ev: Evaluation) -> str:
    """The step's terms on the critical path, and the data-parallel traffic hidden behind backward."""
    t = ev.time
    exposed = [(name, value) for name, value in (("DP", t.data_parallel_exposed), ("TP", t.tensor_parallel),
               ("PP", t.pipeline_parallel), ("EP", t.expert_parallel)) if value]  # fmt: skip
    comm = ", ".join(f"{name} {sig(value)} s" for name, value in exposed) or "none"
    teacher = f" + teacher forward {sig(t.teacher_forward)} s" if t.teacher_forward else ""
    return (
        f"matmuls {sig(t.matmul)} s + memory-bound {sig(t.memory_bound)} s{teacher} + exposed communication ({comm}) + "
        f"bubble {sig(t.bubble)} s; DP {sig(t.data_parallel_overlapped)} s hidden behind backward"
    )


def _stage_lines(plan: CapacityPlan) -> list[str]:
    """Layers and peak GiB of each pipeline stage, the peak stage named (nothing without pipelining)."""
    if len(plan.stages) < 2:
        return []
    cells = ", ".join(f"{m.stage_layers}L {gib(m.total)}" for m in plan.stages)
    peak = plan.requested.memory
    where = f"the {peak.stage} stage" if peak.stage in ("first", "last") else peak.stage
    return [f"pipeline stages (layers, GiB): {cells}; peak on {where} ({peak.stage_layers} layers)"]


_FITTING_COLUMNS = ("layout", "GiB per GPU", "step s", "MFU", "why")
_MISSES_COLUMNS = ("layout", "GiB per GPU", "why not")


def _fitting_rows(plan: CapacityPlan) -> list[tuple[str, str, str, str, str]]:
    """The fastest layouts that fit, with why each ranks where it does."""
    rows = []
    for ev, nxt in ranked(plan.search.fitting):
        why = "; ".join(explain_win(ev, nxt))
        if not plan.runnable(ev):
            why += "; the payload would reject it: " + "; ".join(problem_lines(plan.payload[ev.layout]))
        rows.append((ev.layout.describe(), gib(ev.memory.total), sig(ev.step_seconds), f"{ev.mfu:.1%}", why))
    return rows


def _miss_rows(plan: CapacityPlan) -> list[tuple[str, str, str]]:
    """The nearest layouts that do not fit, with what to attack."""
    return [(ev.layout.describe(), gib(ev.memory.total), ev.why_not()) for ev in plan.search.rejected[:3]]


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
            f"searched {count(plan.search.evaluated)} layouts in {sig(plan.search.seconds)} s; "
            f"{count(plan.search.fitting_count)} fit"
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
    """One line per component of a self-check (see measure.Comparison.as_dict), or per mesh dimension of a
    traffic self-check (tasks/layout_check.py)."""
    if check.get("kind") == "traffic":
        lines = [
            f"self-check {check['label']} on {check['device']}: parameters per rank measured "
            f"{check['measured_param_bytes'] / 1e6:.3f} MB, predicted {check['predicted_param_bytes'] / 1e6:.3f} MB; "
            f"{check['tokens_per_s']:.0f} tokens/s"
        ]
        for dim, row in check["dims"].items():
            ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "n/a"
            lines.append(
                f"  {dim:3s} measured {row['measured_bytes_per_step'] / 1e6:.4f} MB/step  predicted "
                f"{row['predicted_bytes_per_step'] / 1e6:.4f} MB/step  ratio {ratio}"
            )
        return "\n".join(lines)
    predicted, measured = check["predicted_bytes"], check["measured_bytes"]
    lines = [
        f"self-check {check['label']} on {check['device']}: predicted {gib(check['predicted_peak_bytes'])} GiB, "
        f"measured {gib(check['measured_peak_bytes'])} GiB, error {check['error_fraction']:+.2%}"
    ]
    lines += [
        f"  {name:12s} predicted {gib(predicted[name])} GiB  measured {gib(measured[name])} GiB" for name in predicted
    ]
    return "\n".join(lines)
