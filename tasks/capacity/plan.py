"""The capacity plan of a deployment: the requested layout's memory, time and traffic, and the layouts that fit."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import fsspec

from tasks.capacity.catalogue import Accelerator, resolve_accelerator
from tasks.capacity.compute import SECONDS_PER_DAY, flops_per_token
from tasks.capacity.config import CapacityConfig
from tasks.capacity.memory import GIB, Layout, Margin, MemoryModel, Precision, Runtime, kv_cache_bytes
from tasks.capacity.params import Architecture, count_params
from tasks.capacity.payload import parallel_section, parallel_yaml, payload_problems, planner_schedule, problem_lines
from tasks.capacity.search import (
    Estimator,
    Evaluation,
    SearchResult,
    enumerate_layouts,
    explain_win,
    ranked,
    search,
)
from tasks.cluster import ClusterConfig
from tasks.errors import UserError
from training.config import ModelConfig, ParallelConfig, PrecisionConfig, Problem, RunConfig

log = logging.getLogger(__name__)


class CapacityError(UserError):
    """The requested layout does not fit; says what it needs, what there is, and which layouts would fit."""

    def __init__(self, layout: str, needed_bytes: float, usable_bytes: float, detail: str, fitting: list[str]) -> None:
        alternatives = "; ".join(fitting) if fitting else "none: add GPUs, use a larger accelerator or a smaller batch"
        super().__init__(
            f"layout {layout} does not fit: {detail}",
            f"layouts that fit, fastest first: {alternatives}",
        )
        self.layout, self.needed_bytes, self.usable_bytes, self.fitting = layout, needed_bytes, usable_bytes, fitting


@dataclass
class CapacityPlan:
    """Everything the plan found; `to_json()` is plan.json."""

    name: str
    arch: Architecture
    accelerator: Accelerator
    cluster: ClusterConfig
    capacity: CapacityConfig
    precision: Precision
    requested: Evaluation
    search: SearchResult
    train_tokens: float
    kv_cache_bytes: float
    warnings: list[str] = field(default_factory=list)
    self_check: list[dict[str, Any]] = field(default_factory=list)
    model: ModelConfig | None = None
    parallel: ParallelConfig | None = None
    payload: dict[Layout, list[Problem]] = field(default_factory=dict)
    """Why the payload would not run a layout (empty list: it runs), for the requested and the fitting ones."""

    def runnable(self, ev: Evaluation) -> bool:
        """Whether the payload runs the evaluated layout as planned."""
        return not self.payload.get(ev.layout, [])

    def chosen(self) -> Evaluation | None:
        """The layout `--emit-parallel` prints: the fastest fitting one the payload runs, else the fastest fitting."""
        runnable = [ev for ev in self.search.fitting if self.runnable(ev)]
        return (runnable or self.search.fitting or [None])[0]

    def parallel_of(self, ev: Evaluation) -> ParallelConfig:
        """The `parallel` section that runs `ev`'s layout, the spec's other parallel fields kept."""
        assert self.parallel is not None, "the plan was made without the spec's parallel section"
        return parallel_section(ev.layout, self.parallel)

    def emit_parallel(self) -> str:
        """The chosen layout's `parallel:` section as YAML, with what it is and, if the payload rejects it, why."""
        ev = self.chosen()
        if ev is None:
            raise self.error()
        comments = [
            f"tdeploy plan {self.name}: fastest fitting layout {ev.layout.describe()} on {self.cluster.nodes} x "
            f"{self.cluster.procs_per_node} {self.accelerator.name}",
            f"{ev.memory.total / GIB:.3g} GiB per device of {ev.usable_bytes / GIB:.3g} GiB usable, "
            f"{ev.step_seconds:.3g} s per step, MFU {ev.mfu:.1%}",
        ]
        return parallel_yaml(self.parallel_of(ev), comments, self.payload.get(ev.layout, []))

    @property
    def fits(self) -> bool:
        """Whether the requested layout fits."""
        return self.requested.fits

    @property
    def steps(self) -> float:
        """Optimizer steps the token budget takes."""
        return self.train_tokens / (self.requested.layout.global_batch * self.arch.seq_len)

    def error(self) -> CapacityError:
        """The failure to raise when the requested layout does not fit."""
        ev = self.requested
        return CapacityError(
            ev.layout.describe(),
            ev.memory.total,
            ev.usable_bytes,
            ev.why_not(),
            [
                f"{e.layout.describe()} ({e.memory.total / GIB:.1f} GiB, {e.step_seconds:.3g} s/step)"
                for e in self.search.fitting
            ],
        )

    def to_json(self) -> dict[str, Any]:
        """Machine-readable plan: every figure with its unit in its key."""
        pc = count_params(self.arch)
        flops = flops_per_token(self.arch, self.requested.layout.recompute)
        return {
            "name": self.name,
            "fits": self.fits,
            "model": {
                "architecture": asdict(self.arch),
                "params": pc.total,
                "params_embedding": pc.embedding + pc.positions,
                "params_per_block": pc.per_layer,
                "params_output_layer": pc.head,
                "params_experts": pc.experts,
                "params_active_per_token": pc.active_per_token,
            },
            "cluster": {
                "nodes": self.cluster.nodes,
                "gpus_per_node": self.cluster.procs_per_node,
                "world_size": self.cluster.world_size,
                "accelerator": asdict(self.accelerator) | {"memory_bytes": self.accelerator.memory_bytes},
            },
            "assumptions": {
                "precision_recipe": self.precision.recipe,
                "weight_bytes_per_param": self.precision.weight_bytes,
                "grad_bytes_per_param": self.precision.grad_bytes,
                "optimizer_bytes_per_param": self.precision.optimizer_bytes,
                "attention": self.capacity.attention,
                "headroom_fraction": self.capacity.headroom_fraction,
                "fragmentation_fraction": self.capacity.fragmentation_fraction,
                "framework_overhead_bytes": framework_overhead_gib(self.capacity, self.accelerator) * GIB,
                "mfu_assumed": self.capacity.mfu,
                "achieved_flops_per_gpu": (self.capacity.achieved_tflops_per_gpu or 0) * 1e12 or None,
                "comm_overlap": self.capacity.comm_overlap,
            },
            "requested": _evaluation_json(self.requested) | self._payload_json(self.requested),
            "flops": {
                "per_token_forward_flops": flops.forward,
                "per_token_model_flops": flops.model,
                "per_token_hardware_flops": flops.hardware,
                "per_step_model_flops": self.requested.model_flops_per_step,
                "per_step_hardware_flops": self.requested.hardware_flops_per_step,
            },
            "training": {
                "tokens": self.train_tokens,
                "steps": self.steps,
                "seconds": self.steps * self.requested.step_seconds,
                "days": self.steps * self.requested.step_seconds / SECONDS_PER_DAY,
            },
            "inference_kv_cache": {
                "batch_sequences": self.requested.layout.micro_batch,
                "context_tokens": self.arch.seq_len,
                "bytes_per_element": 2,
                "bytes": self.kv_cache_bytes,
            },
            "search": {
                "evaluated_layouts": self.search.evaluated,
                "fitting_layouts": self.search.fitting_count,
                "seconds": self.search.seconds,
                "runnable_only": self.capacity.search_runnable_only,
                "best": [
                    _evaluation_json(e) | {"why": explain_win(e, nxt)} | self._payload_json(e)
                    for e, nxt in ranked(self.search.fitting)
                ],
                "rejected_nearest": [_evaluation_json(e) | {"why_not": e.why_not()} for e in self.search.rejected],
            },
            "warnings": self.warnings,
            "self_check": self.self_check,
        }

    def _payload_json(self, ev: Evaluation) -> dict[str, Any]:
        """The payload's `parallel` fields for the layout and why it would not run (empty: it runs)."""
        if self.parallel is None:
            return {}
        return {
            "parallel": self.parallel_of(ev).model_dump(mode="json"),
            "runnable": self.runnable(ev),
            "payload_problems": problem_lines(self.payload.get(ev.layout, [])),
        }


def _evaluation_json(ev: Evaluation) -> dict[str, Any]:
    lo = ev.layout
    return {
        "layout": asdict(lo) | {"world": lo.world, "global_batch_sequences": lo.global_batch, "name": lo.describe()},
        "fits": ev.fits,
        "memory": ev.memory.as_dict(),
        "usable_bytes": ev.usable_bytes,
        "compute_seconds": ev.compute_seconds,
        "communication": {
            "bytes_per_gpu": ev.comm.bytes,
            "seconds": ev.comm.seconds,
            "exposed_seconds": ev.comm.exposed_seconds,
            "ratio_to_compute": ev.comm.ratio_to_compute,
        },
        "pipeline_bubble_seconds": ev.comm.bubble_seconds,
        "step_seconds": ev.step_seconds,
        "mfu": ev.mfu,
        "warnings": ev.comm.warnings,
    }


def requested_layout(capacity: CapacityConfig, cluster: ClusterConfig, parallel: ParallelConfig) -> Layout:
    """The layout the spec asks for: the payload's `parallel` section, or `capacity.layout` on top of DDP/FSDP/HSDP."""
    lo = capacity.layout
    world = cluster.world_size
    zero = {"ddp": 0, "fsdp": 3, "hsdp": 3}[parallel.sharding]
    if lo is None:
        tp, pp, ep, sp = (parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel,
                          parallel.sequence_parallel)  # fmt: skip
        schedule, virtual = planner_schedule(parallel.pipeline_schedule), parallel.virtual_stages
        micro = parallel.micro_batch
        dp = world // (tp * pp)
        default_batch = parallel.micro_batch * parallel.grad_accum_steps * dp
        if pp > 1:  # the pipeline splits micro_batch x grad_accum_steps sequences into its microbatches
            micro = parallel.micro_batch * parallel.grad_accum_steps // parallel.n_microbatches
    else:
        tp, pp, ep, sp = lo.tensor_parallel, lo.pipeline_parallel, lo.expert_parallel, lo.sequence_parallel
        schedule, virtual = lo.pipeline_schedule, lo.virtual_stages
        dp = world // (tp * pp)
        default_batch = parallel.micro_batch * parallel.grad_accum_steps * world
        micro = parallel.micro_batch
        if lo.zero_stage is not None:
            zero = lo.zero_stage
    shard = None
    if parallel.sharding == "hsdp" and zero == 3:
        node_shard = cluster.procs_per_node // tp if parallel.model_parallel else cluster.procs_per_node
        shard = parallel.hsdp_shard_size or node_shard
    global_batch = capacity.global_batch or default_batch
    return Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        ep=ep,
        zero=zero,
        shard_group=shard if shard != dp else None,
        micro_batch=micro,
        grad_accum=global_batch // (dp * micro),
        recompute=parallel.activation_recompute,
        sequence_parallel=sp,
        pp_schedule=schedule,  # type: ignore[arg-type]
        virtual_stages=virtual,
    )


def _calibration_scale(capacity: CapacityConfig, accelerator: str) -> float:
    if capacity.calibration_url is None:
        return 1.0
    with fsspec.open(capacity.calibration_url, "r") as handle:
        corrections = json.load(handle)
    return float(corrections.get(accelerator, {}).get("peak_scale", 1.0))


def framework_overhead_gib(capacity: CapacityConfig, acc: Accelerator) -> float:
    """The spec's figure, else 1 GiB per GPU (CUDA context, NCCL, cuBLAS workspaces) and nothing on CPU."""
    if capacity.framework_overhead_gib is not None:
        return capacity.framework_overhead_gib
    return 1.0 if acc.kind == "gpu" else 0.0


def make_estimator(
    arch: Architecture, capacity: CapacityConfig, cluster: ClusterConfig, precision: PrecisionConfig
) -> Estimator:
    """An estimator for the spec's model, cluster, precision and assumptions."""
    acc = resolve_accelerator(cluster.accelerator, capacity.accelerator_overrides())
    prec = Precision.of(precision.dtype, capacity.mixed_precision)
    runtime = Runtime(attention=capacity.attention, device=acc.kind, foreach_optimizer=acc.kind == "gpu")
    margin = Margin(
        fragmentation_fraction=capacity.fragmentation_fraction + _calibration_scale(capacity, acc.name) - 1,
        framework_bytes=framework_overhead_gib(capacity, acc) * GIB,
    )
    return Estimator(
        arch=arch,
        memory=MemoryModel(arch, prec, runtime, margin),
        accelerator=acc,
        gpus_per_node=cluster.procs_per_node,
        usable_bytes=acc.memory_bytes * (1 - capacity.headroom_fraction),
        efficiency=capacity.mfu,
        achieved_flops=capacity.achieved_tflops_per_gpu * 1e12 if capacity.achieved_tflops_per_gpu else None,
        comm_overlap=capacity.comm_overlap,
        comm_warn_ratio=capacity.comm_warn_ratio,
    )


class _PayloadCheck:
    """payload_problems memoised on what they depend on (not the recompute mode)."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, dtype: str, cluster: ClusterConfig) -> None:
        self.model, self.parallel, self.dtype, self.cluster = model, parallel, dtype, cluster
        self._seen: dict[Layout, list[Problem]] = {}

    def __call__(self, lo: Layout) -> list[Problem]:
        key = replace(lo, recompute="none")
        if key not in self._seen:
            c = self.cluster
            self._seen[key] = payload_problems(lo, self.model, self.parallel, self.dtype, c.nodes, c.procs_per_node)
        return self._seen[key]


def plan_capacity(
    name: str,
    capacity: CapacityConfig,
    cluster: ClusterConfig,
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    run: RunConfig,
) -> CapacityPlan:
    """Estimate the requested layout and search the alternatives (the spec has been validated); with
    capacity.search_runnable_only the search skips layouts the payload would reject."""
    arch = Architecture.from_model_config(model, name=name)
    est = make_estimator(arch, capacity, cluster, precision)
    layout = requested_layout(capacity, cluster, parallel)
    requested = est.evaluate(layout)
    check = _PayloadCheck(model, parallel, precision.dtype, cluster)
    layouts = enumerate_layouts(
        arch, cluster.world_size, cluster.procs_per_node, layout.global_batch, capacity.max_micro_batch
    )
    if capacity.search_runnable_only:
        layouts = (lo for lo in layouts if not check(lo))
    found = search(est, layouts, top=capacity.search_top)
    tokens = capacity.train_tokens or run.steps * layout.global_batch * model.seq_len
    warnings = list(requested.comm.warnings)
    if not requested.fits:
        warnings.append(f"the requested layout does not fit: {requested.why_not()}")
    plan = CapacityPlan(
        name=name,
        arch=arch,
        accelerator=est.accelerator,
        cluster=cluster,
        capacity=capacity,
        precision=est.memory.p,
        requested=requested,
        search=found,
        train_tokens=float(tokens),
        kv_cache_bytes=kv_cache_bytes(arch, layout.micro_batch, model.seq_len),
        warnings=warnings,
        model=model,
        parallel=parallel,
        payload={ev.layout: check(ev.layout) for ev in [requested, *found.fitting]},
    )
    for warning in warnings:
        log.warning("%s", warning)
    return plan


PLAN_JSON = "plan.json"
"""The plan's file name (its reader: the diagnosis)."""


def plan_location(name: str, capacity: CapacityConfig, folder: str | None = None) -> str:
    """Where plan.json goes: `folder`, else capacity.output_url (a spec sets it to its deployment_dir,
    runs/<name>), else runs/<name>."""
    return f"{(folder or capacity.output_url or f'runs/{name}').rstrip('/')}/{PLAN_JSON}"


def write_plan(plan: CapacityPlan, folder: str | None = None) -> str:
    """Write plan.json (see plan_location); returns its URL."""
    url = plan_location(plan.name, plan.capacity, folder)
    root = url.rsplit("/", 1)[0]
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(root if "://" not in root else path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as handle:
        json.dump(plan.to_json(), handle, indent=2)
    return url


def calibration_from(accelerator: str, comparisons: list[Any]) -> dict[str, dict[str, float]]:
    """A calibration entry (for capacity.calibration_url) from self-check comparisons: the worst measured/predicted."""
    scale = max(c.measured_peak / c.predicted_peak for c in comparisons)
    return {accelerator: {"peak_scale": scale, "cases": len(comparisons)}}
