"""The planner's layouts in the payload's terms: the `parallel` section that runs one, and why the payload would not.

The planner searches more than the payload runs (ZeRO-1/2, tensor or pipeline parallelism on MoE models, ...).
`payload_problems` applies the payload's own checks (training/layout.py, the same the spec and every training
process apply) to the section a layout maps to, so planner and payload agree on what runs.
"""

from __future__ import annotations

from typing import Any

import yaml

from training.config import ModelConfig, ParallelConfig, Problem
from training.layout import Layout, layout_problems, world_problems

LAYOUT_FIELDS = (
    "sharding",
    "hsdp_shard_size",
    "tensor_parallel",
    "sequence_parallel",
    "pipeline_parallel",
    "pipeline_schedule",
    "virtual_stages",
    "pipeline_microbatches",
    "expert_parallel",
    "context_parallel",
    "micro_batch",
    "grad_accum_steps",
    "activation_recompute",
)
"""The fields a planner layout decides; the others are carried over from the spec's section."""


def _sharding(lo: Layout) -> tuple[str, int | None]:
    """(sharding, hsdp_shard_size) of a ZeRO-0/3 layout; ZeRO-1/2 have no payload equivalent (see payload_problems)."""
    if lo.zero == 0 or lo.dp == 1:
        return "ddp", None
    if lo.shard < lo.dp:
        return "hsdp", lo.shard
    return "fsdp", None


def parallel_section(lo: Layout, base: ParallelConfig) -> ParallelConfig:
    """The `parallel` section that runs `lo`: its degrees, sharding and batching, the rest of `base` kept."""
    sharding, shard = _sharding(lo)
    model_parallel = lo.tp > 1 or lo.pp > 1 or lo.ep > 1
    interleaved = lo.pp > 1 and lo.pp_schedule == "interleaved-1f1b"
    update: dict[str, Any] = {
        "sharding": sharding,
        "hsdp_shard_size": shard,
        "data_parallel": None,
        "tensor_parallel": lo.tp,
        "sequence_parallel": lo.sequence_parallel and lo.tp > 1,
        "pipeline_parallel": lo.pp,
        "pipeline_schedule": lo.pp_schedule if lo.pp > 1 else "1f1b",
        "virtual_stages": lo.virtual_stages if interleaved else 1,
        # The payload folds gradient accumulation into the pipeline's microbatches: one per planned micro-batch.
        "pipeline_microbatches": None,
        "expert_parallel": lo.ep,
        "context_parallel": lo.cp,
        "micro_batch": lo.micro_batch,
        "grad_accum_steps": lo.grad_accum,
        "activation_recompute": lo.recompute,
    }
    update["pipeline_split"] = list(lo.split) if lo.pp > 1 and lo.split else None
    if model_parallel or sharding != "ddp":
        update["ddp_grad_compression"] = None  # a DDP comm hook: FSDP2 paths have none
    return ParallelConfig.model_validate(base.model_dump() | update)


def payload_problems(
    lo: Layout, model: ModelConfig, base: ParallelConfig, dtype: str, nodes: int, procs_per_node: int
) -> list[Problem]:
    """Why the payload would reject `lo` (empty: it runs), as the spec reports them: field, value, fix."""
    problems: list[Problem] = []
    if lo.zero in (1, 2) and lo.dp > 1:
        problems.append(
            (
                ("parallel", "sharding"),
                f"zero{lo.zero}",
                f"ZeRO-{lo.zero} (optimizer states{' and gradients' if lo.zero == 2 else ''} sharded, weights "
                "replicated) is planned only; the payload shards with FSDP2: use sharding fsdp or hsdp (ZeRO-3)",
            )
        )
    par = parallel_section(lo, base)
    problems += layout_problems(model, par, dtype)
    world = nodes * procs_per_node
    problems += world_problems(par, world, procs_per_node, f"cluster.nodes x cluster.procs_per_node = {world}")
    if dtype == "fp16" and par.sharding != "ddp":
        problems.append(
            (("precision", "dtype"), "fp16", "fp16 loss scaling runs with sharding=ddp only; use bf16 with fsdp/hsdp")
        )
    return problems


def problem_lines(problems: list[Problem]) -> list[str]:
    """`field=value: fix` lines, as the spec's errors read."""
    return [f"{'.'.join(str(p) for p in loc)}={value}: {message}" for loc, value, message in problems]


def _fields(par: ParallelConfig) -> dict[str, Any]:
    """The layout's fields always, the others where they differ from their defaults."""
    defaults = {name: info.default for name, info in ParallelConfig.model_fields.items()}
    dumped = par.model_dump(mode="json")
    out = {name: dumped[name] for name in LAYOUT_FIELDS if dumped[name] is not None}
    if par.pipeline_parallel == 1:
        for name in ("pipeline_schedule", "virtual_stages", "pipeline_microbatches"):
            out.pop(name, None)
    out |= {
        name: value
        for name, value in dumped.items()
        if name not in out and name not in LAYOUT_FIELDS and value != defaults.get(name) and value is not None
    }
    return out


def parallel_yaml(par: ParallelConfig, comments: list[str], problems: list[Problem]) -> str:
    """The `parallel:` section as YAML, after `# ` comment lines; a layout the payload rejects says what to change."""
    lines = [f"# {c}" for c in comments]
    if problems:
        lines.append("# NOT RUNNABLE as is; change first:")
        lines += [f"#   {line}" for line in problem_lines(problems)]
    body = yaml.safe_dump({"parallel": _fields(par)}, sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + ("\n" if lines else "") + body
