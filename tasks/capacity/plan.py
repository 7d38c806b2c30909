"""The capacity plan of a deployment: the requested layout's memory, time and traffic, and the layouts that fit."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tasks.capacity import calibration as calib
from tasks.capacity.calibration import Calibration
from tasks.capacity.catalogue import Accelerator, resolve_accelerator
from tasks.capacity.compute import SECONDS_PER_DAY, budget_time, flops_conventions, flops_per_token
from tasks.capacity.config import CapacityConfig
from tasks.capacity.memory import GIB, Margin, MemoryBreakdown, MemoryModel, Precision, Runtime, kv_cache_bytes
from tasks.capacity.params import Architecture, count_params
from tasks.capacity.record import write_plan_file
from tasks.capacity.payload import parallel_section, parallel_yaml, payload_problems, problem_lines
from tasks.capacity.scaling import CHINCHILLA_FIT, tokens_per_param_optimal
from tasks.capacity.search import (
    Estimator,
    Evaluation,
    SearchResult,
    enumerate_layouts,
    explain_win,
    ranked,
    search,
)
from tasks.capacity.serving import ServingPlan, ServingSettings, plan_serving
from tasks.capacity.teacher import TeacherLoad
from tasks.errors import UserError
from tasks.launch.cluster import ClusterConfig
from tasks.paths import plan_location
from training.checkpoint.memory_auto import HEADROOM as TIER_HEADROOM
from training.checkpoint.memory_auto import KEPT_STEPS, tier_bytes_per_node
from training.config import DistillConfig, ModelConfig, ParallelConfig, PrecisionConfig, Problem, RunConfig
from training.layout import PLANNED_ONLY, Layout
from training.storage import StorageConfig
from validation.plan_accuracy import PlannedFigures

if TYPE_CHECKING:
    from tasks.capacity.interval import IntervalPlan
    from tasks.serve.config import ServeConfig

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
    stages: list[MemoryBreakdown] = field(default_factory=list)
    """The requested layout's peak memory on each pipeline stage, in order (one entry without pipelining)."""
    serving: ServingPlan | None = None
    """The trained model served as the spec's `serve` section says (None: the spec serves nothing)."""
    checkpoint_interval: IntervalPlan | None = None
    """Each checkpoint tier's interval (tasks/capacity/interval.py; set by the capacity step's inputs)."""
    calibration: Calibration = calib.NONE
    """The measured / planned factors this plan applies (calibration file or the ledger's accepted runs)."""
    uncalibrated: PlannedFigures | None = None
    """The planner's own figures for the requested layout, before calibration: what acceptance compares."""
    teacher: TeacherLoad | None = None
    """distill: the frozen teacher each rank holds and runs forward (tasks/capacity/teacher.py; None: no distill)."""

    def planned(self) -> PlannedFigures:
        """The requested layout's figures as acceptance compares them with a run (uncalibrated)."""
        return self.uncalibrated or planned_figures(self.accelerator.name, self.requested, self.stages)

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
        """Whether the requested layout fits on the device and its offloaded states in the node's host memory."""
        return self.requested.fits and self.host_memory().problem is None

    @property
    def steps(self) -> float:
        """Optimizer steps the token budget takes."""
        return self.train_tokens / (self.requested.layout.global_batch * self.arch.seq_len)

    def host_memory(self) -> HostMemory:
        """The requested layout's offloaded states on a node: its ranks x the most any pipeline stage offloads."""
        per_rank = max(m.host_bytes for m in [self.requested.memory, *self.stages])
        return HostMemory(per_rank, self.cluster.procs_per_node, self.capacity.host_memory_gib)

    def memory_tier(self) -> MemoryTierFit:
        """The in-memory checkpoint tier's copies of the requested layout on a node (memory_every_steps=auto)."""
        per_rank = max(checkpointed_bytes(m) for m in [self.requested.memory, *self.stages])
        return MemoryTierFit(per_rank, self.cluster.procs_per_node, self.capacity.host_memory_gib,
                             self.host_memory().per_node_bytes)  # fmt: skip

    def flops_conventions(self) -> list[dict[str, Any]]:
        """Each named FLOPs convention: per token, per step and for the training tokens."""
        lo = self.requested.layout
        per_token = flops_conventions(self.arch, 1.0, lo.recompute)
        step_tokens = lo.global_batch * self.arch.seq_len
        return [
            {"key": c.key, "name": c.name, "source": c.source, "per_token_flops": f,
             "per_step_flops": f * step_tokens, "training_flops": f * self.train_tokens}
            for c, f in per_token.by_convention()
        ]  # fmt: skip

    def flop_budget(self) -> dict[str, Any] | None:
        """capacity.flop_budget: its time on this cluster at the requested layout's MFU, and the compute-optimal
        model size and tokens for it (Hoffmann et al. 2022: Approach 3's fit, and 20 tokens per parameter)."""
        budget = self.capacity.flop_budget
        if budget is None:
            return None
        ev = self.requested
        peak = self.accelerator.peak_flops(self.precision.compute_dtype)
        spent = budget_time(budget, ev.layout.world, peak, ev.mfu)
        fitted, rule = CHINCHILLA_FIT.optimal(budget), tokens_per_param_optimal(budget)
        return {
            "flops": budget,
            "convention": "6ND (model FLOPs at the requested layout's MFU)",
            "seconds": spent.seconds,
            "days": spent.days,
            "compute_optimal": {
                "approach_3_fit": {"params": fitted.params, "tokens": fitted.tokens,
                                   "source": "Hoffmann et al. 2022 eq. 4 with eq. 10's fit"},
                "twenty_tokens_per_param": {"params": rule.params, "tokens": rule.tokens,
                                            "source": "Hoffmann et al. 2022 Table 3 (Approach 1)"},
            },
        }  # fmt: skip

    def error(self) -> CapacityError:
        """The failure to raise when the requested layout does not fit."""
        ev = self.requested
        host = self.host_memory().problem
        return CapacityError(
            ev.layout.describe(),
            ev.memory.total,
            ev.usable_bytes,
            ev.why_not() if not ev.fits or host is None else host,
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
                "params_vision_encoder": pc.encoder,  # a vlm's encoder and projector
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
                "optimizer": self.precision.optimizer,
                "master_bytes_per_param": self.precision.master_bytes,
                "offload": self.capacity.offload,
                "host_memory_bytes_per_node": (self.capacity.host_memory_gib or 0) * GIB or None,
                "attention": self.capacity.attention,
                "headroom_fraction": self.capacity.headroom_fraction,
                "fragmentation_fraction": self.capacity.fragmentation_fraction,
                "framework_overhead_bytes": framework_overhead_gib(self.capacity, self.accelerator) * GIB,
                "mfu_assumed": self.capacity.mfu,
                "achieved_flops_per_gpu": (self.capacity.achieved_tflops_per_gpu or 0) * 1e12 or None,
                "comm_overlap": self.capacity.comm_overlap,
            },
            "requested": _evaluation_json(self.requested)
            | self._payload_json(self.requested)
            | {"stages": [_stage_json(m) for m in self.stages]}
            | {"host_memory": self.host_memory().as_dict()}
            | {"memory_tier": self.memory_tier().as_dict()},
            "flops": {
                "per_token_forward_flops": flops.forward,
                "per_token_model_flops": flops.model,
                "per_token_hardware_flops": flops.hardware,
                "per_step_model_flops": self.requested.model_flops_per_step,
                "per_step_hardware_flops": self.requested.hardware_flops_per_step,
                "conventions": self.flops_conventions(),
                "mfu": self.requested.mfu,
                "hfu": self.requested.hfu,
            },
            "flop_budget": self.flop_budget(),
            "distill_teacher": None if self.teacher is None else self.teacher_json(),
            "calibration": self.calibration.as_dict() | {"uncalibrated": self.planned().model_dump(mode="json")},
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
            "serving": None if self.serving is None else _serving_json(self.serving),
            "checkpoint_interval": None if self.checkpoint_interval is None else self.checkpoint_interval.as_dict(),
            "warnings": self.warnings,
            "self_check": self.self_check,
        }

    def teacher_json(self) -> dict[str, Any]:
        """distill: the teacher's figures and its share of the requested layout's peak and step."""
        assert self.teacher is not None
        ev, tokens = self.requested, self.requested.layout.micro_batch * self.arch.seq_len
        return self.teacher.as_dict() | {
            "logits_bytes": ev.memory.teacher_logits,
            "forward_working_set_bytes": self.teacher.forward_bytes(tokens),
            "forward_flops_per_step": self.teacher.forward_flops_per_token * ev.layout.global_batch * self.arch.seq_len,
            "forward_seconds": ev.time.teacher_forward,
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


@dataclass(frozen=True)
class HostMemory:
    """Offloaded model states in a node's host memory: a rank's, the node's (its ranks x a rank's) and the limit."""

    per_rank_bytes: float
    ranks_per_node: int
    limit_gib: float | None
    """capacity.host_memory_gib; None = not checked."""

    @property
    def per_node_bytes(self) -> float:
        """What the node's ranks offload together."""
        return self.per_rank_bytes * self.ranks_per_node

    @property
    def problem(self) -> str | None:
        """`capacity.host_memory_gib=...: what and the fix` when the node's share exceeds it; None if it fits."""
        if self.limit_gib is None or self.per_node_bytes <= self.limit_gib * GIB:
            return None
        need = self.per_node_bytes / GIB
        return (
            f"capacity.host_memory_gib={self.limit_gib:g}: the offloaded model states need {need:.1f} GiB per node "
            f"({self.ranks_per_node} ranks x {self.per_rank_bytes / GIB:.1f} GiB); raise host_memory_gib to at "
            f"least {math.ceil(need)} if the nodes have it, spread the states over more nodes, or offload less "
            "(capacity.offload)"
        )

    def as_dict(self) -> dict[str, Any]:
        """The figures for plan.json, with the problem (None: fits or not checked)."""
        return {
            "per_rank_bytes": self.per_rank_bytes,
            "ranks_per_node": self.ranks_per_node,
            "per_node_bytes": self.per_node_bytes,
            "limit_bytes": self.limit_gib * GIB if self.limit_gib is not None else None,
            "fits": self.problem is None,
            "problem": self.problem,
        }


def checkpointed_bytes(memory: MemoryBreakdown) -> float:
    """A rank's state as a checkpoint holds it: its weights (on the device, or offloaded) and optimizer state."""
    states = memory.states
    weights = states.weights or states.host_weights  # offloaded weights are the host copy; else it is an extra copy
    return weights + states.optimizer + states.host_optimizer


@dataclass(frozen=True)
class MemoryTierFit:
    """The in-memory checkpoint tier on a node (training/checkpoint/memory_auto.py): what its copies need (kept
    steps x own + peer copy x the node's ranks) against capacity.host_memory_gib less the offloaded states, within
    the tier's headroom; with no host_memory_gib the trainer decides from the memory the node has at start."""

    per_rank_bytes: float
    ranks_per_node: int
    limit_gib: float | None
    offloaded_bytes_per_node: float = 0.0

    @property
    def per_node_bytes(self) -> float:
        """What the tier holds on a node."""
        return tier_bytes_per_node(self.per_rank_bytes, self.ranks_per_node)

    @property
    def allowed_bytes(self) -> float | None:
        """What it may take: the headroom of the host memory the offloaded states leave (None: not known)."""
        if self.limit_gib is None:
            return None
        return TIER_HEADROOM * max(0.0, self.limit_gib * GIB - self.offloaded_bytes_per_node)

    @property
    def fits(self) -> bool | None:
        """Whether memory_every_steps=auto turns the tier on (None: decided by the trainer at start)."""
        allowed = self.allowed_bytes
        return None if allowed is None else self.per_node_bytes <= allowed

    def describe(self) -> str:
        """One line for the report."""
        need = (f"{self.per_node_bytes / GIB:.3g} GiB per node ({self.ranks_per_node} ranks x "
                f"{self.per_rank_bytes / GIB:.3g} GiB x own + peer copy x {KEPT_STEPS} kept steps)")  # fmt: skip
        if self.fits is None:
            return (f"in-memory checkpoints: {need}; on if that fits {TIER_HEADROOM:.0%} of the host memory a node "
                    "has at start (set capacity.host_memory_gib to plan it)")  # fmt: skip
        allowed = f"{(self.allowed_bytes or 0) / GIB:.3g} GiB allowed"
        if self.fits:
            return f"in-memory checkpoints: on (memory_every_steps=auto): {need} of {allowed}"
        return (f"in-memory checkpoints: OFF under memory_every_steps=auto: {need} exceed {allowed} "
                f"({TIER_HEADROOM:.0%} of capacity.host_memory_gib={self.limit_gib:g} less offloaded states); "
                "restarts restore from storage; set checkpoint.memory_budget_mib if the nodes hold more")  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """The figures for plan.json (fits None: the trainer decides at start)."""
        return {
            "per_rank_bytes": self.per_rank_bytes,
            "ranks_per_node": self.ranks_per_node,
            "per_node_bytes": self.per_node_bytes,
            "allowed_bytes": self.allowed_bytes,
            "fits": self.fits,
            "summary": self.describe(),
        }


def _stage_json(memory: MemoryBreakdown) -> dict[str, Any]:
    """One pipeline stage's peak: its name, index, layers and the memory figures."""
    return {"stage": memory.stage, "index": memory.stage_index, "layers": memory.stage_layers} | memory.as_dict()


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
        "step_time": ev.time.terms(),
        "mfu": ev.mfu,
        "hfu": ev.hfu,
        "warnings": ev.comm.warnings,
    }


def requested_layout(capacity: CapacityConfig, cluster: ClusterConfig, parallel: ParallelConfig) -> Layout:
    """The layout the spec asks for: the payload's `parallel` section (Layout.of), or `capacity.layout` applied to
    it: the override's degrees and schedule over the section's sharding and micro-batch, a global batch of
    micro_batch x grad_accum_steps x every rank and the override's zero_stage where set."""
    world, per_node = cluster.world_size, cluster.procs_per_node
    override = capacity.layout
    if override is None:
        lo = Layout.of(parallel, world, per_node, capacity.global_batch)
        return replace(lo, shard_group=None) if lo.shard_group == lo.dp else lo
    section = override.applied_to(parallel).model_copy(update={"pipeline_microbatches": None})
    planned = Layout.of(section, world, per_node)
    zero = override.zero_stage if override.zero_stage is not None else planned.zero
    shard = None
    if parallel.sharding == "hsdp" and zero == 3:
        shard = parallel.hsdp_shard_size or (per_node // planned.tp if parallel.model_parallel else per_node)
    batch = capacity.global_batch or parallel.micro_batch * parallel.grad_accum_steps * world
    return replace(
        planned,
        zero=zero,
        shard_group=shard if shard != planned.dp else None,
        micro_batch=parallel.micro_batch,
        grad_accum=batch // (planned.dp * parallel.micro_batch),
    )


def planned_figures(accelerator: str, requested: Evaluation, stages: list[MemoryBreakdown]) -> PlannedFigures:
    """The figures acceptance holds a run to: step time and each pipeline stage's allocated peak."""
    return PlannedFigures(
        accelerator=accelerator,
        layout=requested.layout.describe(),
        step_seconds=requested.step_seconds,
        stage_peak_bytes=[m.allocated_peak for m in stages] or [requested.memory.allocated_peak],
    )


def framework_overhead_gib(capacity: CapacityConfig, acc: Accelerator) -> float:
    """The spec's figure, else 1 GiB per GPU (CUDA context, NCCL, cuBLAS workspaces) and nothing on CPU."""
    if capacity.framework_overhead_gib is not None:
        return capacity.framework_overhead_gib
    return 1.0 if acc.kind == "gpu" else 0.0


def make_estimator(
    arch: Architecture,
    capacity: CapacityConfig,
    cluster: ClusterConfig,
    precision: PrecisionConfig,
    calibration: Calibration = calib.NONE,
    teacher: Architecture | None = None,
) -> Estimator:
    """An estimator for the spec's model, cluster, precision and assumptions, with `calibration` applied;
    `teacher`: the distillation teacher every rank holds and runs forward (None: no distillation)."""
    acc = resolve_accelerator(cluster.accelerator, capacity.accelerator_overrides())
    prec = Precision.of(precision.dtype, capacity.mixed_precision, capacity.optimizer, capacity.grad_dtype, arch)
    runtime = Runtime(attention=capacity.attention, device=acc.kind, foreach_optimizer=acc.kind == "gpu")
    margin = Margin(
        fragmentation_fraction=max(0.0, capacity.fragmentation_fraction + calibration.memory_scale - 1),
        framework_bytes=framework_overhead_gib(capacity, acc) * GIB,
    )
    load = None if teacher is None else TeacherLoad.of(teacher, prec, runtime)
    return Estimator(
        arch=arch,
        memory=MemoryModel(arch, prec, runtime, margin, offload=capacity.offload, teacher=load),
        accelerator=acc,
        gpus_per_node=cluster.procs_per_node,
        usable_bytes=acc.memory_bytes * (1 - capacity.headroom_fraction),
        efficiency=capacity.mfu,
        achieved_flops=capacity.achieved_tflops_per_gpu * 1e12 if capacity.achieved_tflops_per_gpu else None,
        comm_overlap=capacity.comm_overlap,
        comm_warn_ratio=capacity.comm_warn_ratio,
        bandwidth_efficiency=capacity.memory_bandwidth_efficiency,
        overlap_fraction=capacity.dp_overlap_fraction,
        scatter_gather=capacity.pipeline_scatter_gather,
        compute_scale=calibration.step_time_scale,
        teacher_flops_per_token=0.0 if load is None else load.forward_flops_per_token,
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
    serve: ServeConfig | None = None,
    calibration: Calibration | None = None,
    distill: DistillConfig | None = None,
) -> CapacityPlan:
    """Estimate the requested layout and search the alternatives (the spec has been validated); with
    capacity.search_runnable_only the search skips layouts the payload would reject; with `serve`, plan serving
    the trained model too (memory and the largest concurrency that fits). `calibration`: measured / planned
    factors (None: capacity.calibration_url's entry for the accelerator, if set). `distill`: its teacher
    (teacher_model, as the spec fills it in) is held and run forward by every rank."""
    arch = Architecture.from_model_config(model, name=name)
    teacher = None
    if distill is not None and distill.teacher_model is not None:
        # The payload runs the teacher on the student's sequences (load_teacher).
        teacher = Architecture.from_model_config(distill.teacher_model.model_copy(update={"seq_len": model.seq_len}),
                                                 name=f"{name}-teacher")  # fmt: skip
    if calibration is None:
        calibration = (
            calib.from_file(capacity.calibration_url, cluster.accelerator) if capacity.calibration_url else calib.NONE
        )
    est = make_estimator(arch, capacity, cluster, precision, calibration, teacher)
    layout = requested_layout(capacity, cluster, parallel)
    requested = est.evaluate(layout)
    uncalibrated = None
    if calibration != calib.NONE:
        raw = make_estimator(arch, capacity, cluster, precision, teacher=teacher)
        uncalibrated = planned_figures(cluster.accelerator, raw.evaluate(layout), raw.memory.stages(layout))
    check = _PayloadCheck(model, parallel, precision.dtype, cluster)
    layouts = enumerate_layouts(
        arch,
        cluster.world_size,
        cluster.procs_per_node,
        layout.global_batch,
        capacity.max_micro_batch,
        # a planned-only degree is searched when the whole search is asked for (PLANNED_ONLY: what the payload runs)
        context_parallel=capacity.attention == "flash"
        and ("context_parallel" not in PLANNED_ONLY or not capacity.search_runnable_only),
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
        stages=est.memory.stages(layout),
        serving=None if serve is None else serving_plan(arch, est.accelerator, serve, precision),
        calibration=calibration,
        uncalibrated=uncalibrated,
        teacher=est.memory.teacher,
    )
    if distill is not None and teacher is None:
        warnings.append("distill: the teacher's architecture is unknown (distill.teacher_model), so the plan leaves "
                        "out its weights, logits and forward; state teacher_model or make teacher_url readable")  # fmt: skip
    if plan.serving is not None:
        warnings += [f"serving: {p.message}" for p in plan.serving.problems]
    if capacity.optimizer != "adamw" or capacity.offload != "none":
        warnings.append(
            f"planned with capacity.optimizer={capacity.optimizer}, offload={capacity.offload}: the payload trains "
            "with AdamW (optim.name) on the device, so this plan is for another trainer's job"
        )
    host = plan.host_memory().problem
    if host is not None:
        warnings.append(f"the offloaded states do not fit the nodes' host memory: {host}")
    for warning in warnings:
        log.warning("%s", warning)
    return plan


def make_plan(
    name: str,
    capacity: CapacityConfig,
    cluster: ClusterConfig,
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    run: RunConfig,
    serve: ServeConfig | None = None,
    ledger: str | None = None,
    storage: StorageConfig | None = None,
    distill: DistillConfig | None = None,
) -> CapacityPlan:
    """The deployment's plan (`tdeploy plan` and the capacity step): `plan_capacity`, calibrated from the
    ledger's accepted runs on the accelerator where `ledger` has some, else from capacity.calibration_url."""
    from tasks.ledger.registry import Ledger  # noqa: PLC0415 - the ledger imports acceptance, which is heavier

    accuracies = Ledger(ledger, storage).plan_accuracies(cluster.accelerator) if ledger else []
    calibration = calib.calibration_for(capacity.calibration_url, cluster.accelerator, accuracies)
    return plan_capacity(name, capacity, cluster, model, parallel, precision, run, serve, calibration, distill)


def _serving_json(plan: ServingPlan) -> dict[str, Any]:
    """The serving plan's figures per GPU (bytes), limits and problems."""
    m = plan.memory
    return {
        "engine": "vllm",
        "settings": asdict(plan.settings),
        "device_bytes": m.device,
        "budget_bytes": m.budget,
        "weights_bytes": m.weights,
        "activations_peak_bytes": m.activations.peak,
        "overhead_bytes": m.overhead,
        "kv_cache_budget_bytes": m.kv_budget,
        "kv_cache_bytes_per_token": m.kv_bytes_per_token,
        "kv_cache_blocks": m.num_blocks,
        "context_tokens": m.context,
        "concurrent_sequences": m.concurrent,
        "max_concurrency": m.max_concurrency,
        "concurrency": plan.concurrency,
        "fits": plan.fits,
        "problems": [p.message for p in plan.problems],
    }


def serving_plan(
    arch: Architecture, accelerator: Accelerator, serve: ServeConfig, precision: PrecisionConfig
) -> ServingPlan:
    """The serving plan of `serve` (the settings `tdeploy serve` starts vLLM with) on `accelerator`, for a model
    trained at `precision` (served in it unless serve.dtype says otherwise)."""
    settings = ServingSettings.of(serve, accelerator, precision)
    return plan_serving(arch, accelerator, settings, serve.max_model_len)


def write_plan(plan: CapacityPlan, folder: str | None = None) -> str:
    """Write plan.json (see plan_location; tasks.capacity.record reads it back); returns its URL."""
    url = plan_location(plan.name, plan.capacity, folder)
    write_plan_file(url, plan.to_json())
    return url


def calibration_from(accelerator: str, comparisons: list[Any]) -> dict[str, dict[str, float]]:
    """A calibration entry (for capacity.calibration_url) from self-check comparisons: the worst measured/predicted."""
    scale = max(c.measured_peak / c.predicted_peak for c in comparisons)  # read by calibration.from_file
    return {accelerator: {"peak_scale": scale, "cases": len(comparisons)}}
