"""Evaluate layouts and search them: keep what fits with the headroom, rank by step time, say why.

The global batch stays fixed: for each data-parallel degree the micro-batch varies and gradient accumulation
absorbs the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from tasks.capacity.catalogue import Accelerator
from tasks.capacity.comm import CommEstimate, communication
from tasks.capacity.compute import flops_per_token, flops_utilization
from tasks.capacity.memory import MemoryBreakdown, MemoryModel
from tasks.capacity.params import Architecture
from tasks.capacity.timing import StepTime, memory_bound
from tasks.capacity.units import gib, sig
from training.config import divisors
from training.layout import Layout


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class Evaluation:
    """One layout: its memory, time and whether it fits."""

    layout: Layout
    memory: MemoryBreakdown
    usable_bytes: float
    comm: CommEstimate
    time: StepTime
    mfu: float
    hfu: float
    model_flops_per_step: float
    hardware_flops_per_step: float

    @property
    def compute_seconds(self) -> float:
        """Matmuls and memory-bound work of a step."""
        return self.time.compute

    @property
    def step_seconds(self) -> float:
        """The whole step (see `StepTime`)."""
        return self.time.total

    @property
    def fits(self) -> bool:
        """Whether the peak plus margin stays within the usable memory."""
        return self.memory.total <= self.usable_bytes

    @property
    def largest_component(self) -> tuple[str, float]:
        """(name, bytes) of the biggest part of the peak."""
        m = self.memory
        parts = {
            "weights": m.weights,
            "gradients": m.gradients,
            "optimizer states": m.optimizer,
            "activations": m.activations + m.weight_copies,
            "buffers": m.buffers,
            "temporaries": m.transient,
            "fragmentation and framework margin": m.margin,
            "distillation teacher (weights and logits)": m.teacher_weights + m.teacher_logits,
        }
        name = max(parts, key=lambda k: parts[k])
        return name, parts[name]

    def why_not(self) -> str:
        """Why the layout does not fit, with the component to attack."""
        name, nbytes = self.largest_component
        return (
            f"needs {gib(self.memory.total)} GiB > {gib(self.usable_bytes)} GiB usable "
            f"(peak at {self.memory.phase}; {name} {gib(nbytes)} GiB is the largest part)"
        )


@dataclass
class Estimator:
    """Evaluates layouts of one model on one cluster; the per-model work is done once."""

    arch: Architecture
    memory: MemoryModel
    accelerator: Accelerator
    gpus_per_node: int
    usable_bytes: float
    efficiency: float
    achieved_flops: float | None = None
    comm_overlap: bool = True
    comm_warn_ratio: float = 1.0
    bandwidth_efficiency: float | None = 0.8
    """Share of the memory bandwidth elementwise kernels reach; None = memory-bound work not modelled."""
    overlap_fraction: float = 1.0
    scatter_gather: bool = False
    compute_scale: float = 1.0
    """Calibration: measured / planned step time, applied to the compute terms (matmuls, memory-bound work)."""
    teacher_flops_per_token: float = 0.0
    """distill: the frozen teacher's forward FLOPs per token (tasks/capacity/teacher.py; 0: no distillation)."""
    _flops: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for mode in ("none", "selective", "full"):
            f = flops_per_token(self.arch, mode)  # type: ignore[arg-type]
            self._flops[mode] = (f.model, f.hardware)

    @property
    def flops_rate(self) -> float:
        """Hardware FLOP/s one GPU sustains."""
        if self.achieved_flops:
            return self.achieved_flops
        return self.accelerator.peak_flops(self.memory.p.compute_dtype) * self.efficiency

    def matmul_seconds(self, layout: Layout) -> float:
        """The step's matmuls at the sustained FLOP rate: a lower bound of its step time."""
        hw_tok = self._flops[layout.recompute][1]
        tokens = layout.global_batch * self.arch.seq_len
        # A pipeline runs at the pace of its busiest stage: uneven stages leave the others waiting.
        imbalance = max(layout.stage_layers(self.arch.n_layers)) * layout.pp / self.arch.n_layers
        return hw_tok * tokens * imbalance / (layout.world * self.flops_rate) * self.compute_scale

    def teacher_seconds(self, layout: Layout) -> float:
        """distill: the teacher's forward on the step's tokens, spread over the ranks at the sustained FLOP rate."""
        if not self.teacher_flops_per_token:
            return 0.0
        tokens = layout.global_batch * self.arch.seq_len
        return self.teacher_flops_per_token * tokens / (layout.world * self.flops_rate) * self.compute_scale

    def evaluate(self, layout: Layout, memory: MemoryBreakdown | None = None) -> Evaluation:
        """Memory, compute, communication and step time of `layout` (`memory`: its estimate, if already made)."""
        mem = memory or self.memory.estimate(layout)
        model_tok, hw_tok = self._flops[layout.recompute]
        tokens = layout.global_batch * self.arch.seq_len
        matmul = self.matmul_seconds(layout)
        bound = 0.0
        if self.bandwidth_efficiency:
            rate = self.accelerator.hbm_tb_s * 1e12 * self.bandwidth_efficiency
            bound = memory_bound(self.arch, self.memory.p, layout, self.memory.rt.attention, rate).seconds
            bound *= self.compute_scale
        teacher = self.teacher_seconds(layout)
        compute = matmul + bound + teacher
        comm = communication(
            self.arch,
            self.memory.params,
            self.memory.p,
            layout,
            self.accelerator,
            self.gpus_per_node,
            compute,
            overlap=self.comm_overlap,
            warn_ratio=self.comm_warn_ratio,
            overlap_fraction=self.overlap_fraction,
            scatter_gather=self.scatter_gather,
        )
        time = StepTime(
            matmul=matmul,
            memory_bound=bound,
            data_parallel_overlapped=comm.hidden_seconds,
            data_parallel_exposed=comm.seconds["data_parallel"] - comm.hidden_seconds,
            tensor_parallel=comm.seconds["tensor_parallel"],
            pipeline_parallel=comm.seconds["pipeline_parallel"],
            expert_parallel=comm.seconds["expert_parallel"],
            bubble=comm.bubble_seconds,
            context_parallel=comm.seconds["context_parallel"],
            teacher_forward=teacher,
        )
        peak = self.accelerator.peak_flops(self.memory.p.compute_dtype)
        return Evaluation(
            layout=layout,
            memory=mem,
            usable_bytes=self.usable_bytes,
            comm=comm,
            time=time,
            mfu=flops_utilization(model_tok * tokens, time.total, layout.world, peak),
            hfu=flops_utilization(hw_tok * tokens, time.total, layout.world, peak),
            model_flops_per_step=model_tok * tokens,
            hardware_flops_per_step=hw_tok * tokens,
        )


def enumerate_layouts(
    arch: Architecture,
    world: int,
    gpus_per_node: int,
    global_batch: int,
    max_micro_batch: int = 64,
    context_parallel: bool = False,
) -> Iterator[Layout]:
    """Every valid layout: DP x TP x PP (x CP) x EP x ZeRO x micro-batch x recompute x SP x schedule for a fixed
    batch. `context_parallel`: also split sequences over cp ranks (cp with seq_len divisible by 2 cp)."""
    tps = [t for t in divisors(gpus_per_node) if arch.n_heads % t == 0 and arch.kv_heads % t == 0]
    for tp in tps:
        for pp in divisors(world // tp) if world % tp == 0 else []:
            if pp > arch.n_layers:
                break
            rest = world // (tp * pp)
            cps = [c for c in divisors(rest) if arch.seq_len % (2 * c) == 0] if context_parallel else [1]
            for cp in cps:
                yield from _layouts_of(arch, tp, pp, cp, rest // cp, gpus_per_node, global_batch, max_micro_batch)


def _layouts_of(
    arch: Architecture,
    tp: int,
    pp: int,
    cp: int,
    dp: int,
    gpus_per_node: int,
    global_batch: int,
    max_micro_batch: int,
) -> Iterator[Layout]:
    """The layouts of one TP x PP x CP x DP grid: EP, ZeRO, micro-batching, recompute, SP and schedule."""
    if global_batch % dp:
        return
    per_rank = global_batch // dp
    eps = [e for e in divisors(dp) if arch.n_experts and arch.n_experts % e == 0] or [1]
    schedules: list[tuple[str, int]] = [("1f1b", 1)]
    # Interleaving splits each stage into v chunks of equal layers: any v > 1 that divides an even stage.
    if pp > 1 and arch.n_layers % pp == 0:
        schedules += [("interleaved-1f1b", v) for v in divisors(arch.n_layers // pp) if v > 1]
    shards = [dp]
    node_shard = gpus_per_node // tp
    if 1 < node_shard < dp and dp % node_shard == 0:
        shards.append(node_shard)
    for mb in divisors(per_rank):
        if mb > max_micro_batch:
            break
        accum = per_rank // mb
        if pp > 1 and accum < pp:
            continue  # fewer micro-batches than stages: the pipeline never fills
        for ep in eps:
            for zero in (0, 1, 2, 3):
                if dp * cp == 1 and zero:
                    continue
                for shard in shards if zero else [dp]:
                    for recompute in ("none", "selective", "full"):
                        for sp in (False, True) if tp > 1 else (False,):
                            for schedule, v in schedules:
                                if schedule == "interleaved-1f1b" and accum % pp:
                                    continue
                                yield Layout(
                                    dp=dp,
                                    tp=tp,
                                    pp=pp,
                                    ep=ep,
                                    cp=cp,
                                    zero=zero,
                                    shard_group=shard if shard != dp else None,
                                    micro_batch=mb,
                                    grad_accum=accum,
                                    recompute=recompute,  # type: ignore[arg-type]
                                    sequence_parallel=sp,
                                    pp_schedule=schedule,  # type: ignore[arg-type]
                                    virtual_stages=v,
                                )


@dataclass
class SearchResult:
    """Layouts that fit, best first, and a sample of those that don't, closest first."""

    evaluated: int
    fitting: list[Evaluation]
    rejected: list[Evaluation]
    fitting_count: int
    seconds: float


def search(estimator: Estimator, layouts: Iterator[Layout], top: int = 5, keep_rejected: int = 5) -> SearchResult:
    """Evaluate every layout; keep the `top` fastest that fit and the `keep_rejected` nearest misses.

    Every layout's memory is estimated; a fitting one is timed in full only while its matmul time (a lower bound
    of its step) could still place it among the `top` fastest so far.
    """
    import heapq
    import time

    started = time.perf_counter()
    fitting: list[Evaluation] = []
    fastest: list[float] = []  # the `top` smallest step times so far, negated (a max-heap)
    count = fitting_count = 0
    misses: list[tuple[float, int, Layout]] = []
    usable = estimator.usable_bytes
    for layout in layouts:
        count += 1
        bound = estimator.memory.states_bound(layout)
        if bound > usable:  # the weights and optimizer states alone do not fit
            misses.append((bound, count, layout))
            continue
        memory = estimator.memory.estimate(layout, limit=usable)
        if memory.total > usable:
            misses.append((memory.total, count, layout))  # a lower bound; time only matters for layouts that fit
            continue
        fitting_count += 1
        if len(fastest) >= top and estimator.matmul_seconds(layout) > -fastest[0] + 1e-9:
            continue  # slower than `top` layouts already found, whatever its communication
        ev = estimator.evaluate(layout, memory)
        fitting.append(ev)
        if len(fastest) < top:
            heapq.heappush(fastest, -ev.step_seconds)
        elif ev.step_seconds < -fastest[0]:
            heapq.heapreplace(fastest, -ev.step_seconds)
    rejected = [estimator.evaluate(layout) for layout in nearest_misses(estimator, misses, keep_rejected)]
    # Ties on step time go to less traffic, then larger micro-batches (fewer, fuller kernels), then less memory.
    fitting.sort(key=lambda e: (round(e.step_seconds, 9), e.comm.total_seconds, -e.layout.micro_batch, e.memory.total))
    return SearchResult(
        evaluated=count,
        fitting=fitting[:top],
        rejected=rejected,
        fitting_count=fitting_count,
        seconds=time.perf_counter() - started,
    )


def nearest_misses(estimator: Estimator, misses: list[tuple[float, int, Layout]], keep: int) -> list[Layout]:
    """The `keep` misses whose whole peak is smallest (ties in enumeration order), from (lower bound of the peak,
    order, layout): exact peaks are computed in order of the bounds until no bound left can beat the kept ones."""
    misses.sort(key=lambda miss: miss[:2])
    exact: list[tuple[float, int, Layout]] = []
    for bound, order, layout in misses:
        if len(exact) >= keep and bound > exact[keep - 1][0]:
            break
        exact.append((estimator.memory.estimate(layout).total, order, layout))
        exact.sort(key=lambda miss: miss[:2])
    return [layout for _, _, layout in exact[:keep]]


def ranked(fitting: list[Evaluation]) -> list[tuple[Evaluation, Evaluation | None]]:
    """Each fitting layout with the one ranked after it (None for the last)."""
    return [(ev, fitting[i + 1] if i + 1 < len(fitting) else None) for i, ev in enumerate(fitting)]


def explain_win(best: Evaluation, runner_up: Evaluation | None) -> list[str]:
    """Why a fitting layout ranks where it does, in a few short reasons."""
    lo, mem = best.layout, best.memory
    spare = best.usable_bytes - mem.total
    reasons = [f"fits with {gib(spare)} GiB to spare of {gib(best.usable_bytes)} GiB usable"]
    extra = best.hardware_flops_per_step / best.model_flops_per_step - 1
    if lo.recompute == "none":
        reasons.append("no activation recompute: no extra forward FLOPs")
    else:
        reasons.append(f"{lo.recompute} recompute adds {extra:.0%} FLOPs to save activation memory")
    if lo.pp > 1:
        reasons.append(f"pipeline bubble {sig(best.comm.bubble_seconds)} s per step")
    if lo.tp > 1:
        reasons.append(f"tensor-parallel traffic {sig(best.comm.seconds['tensor_parallel'])} s per step, not hidden")
    hidden = best.comm.seconds["data_parallel"] - max(
        0.0, best.comm.exposed_seconds - best.comm.seconds["tensor_parallel"] - best.comm.seconds["pipeline_parallel"]
    )
    if best.comm.seconds["data_parallel"]:
        reasons.append(
            f"data-parallel traffic {sig(best.comm.seconds['data_parallel'])} s, "
            f"{sig(hidden)} s of it hidden by backward"
        )
    if runner_up is not None:
        gap = runner_up.step_seconds - best.step_seconds
        if gap > 1e-9:
            reasons.append(f"{sig(gap)} s per step faster than the next ({runner_up.layout.describe()})")
        else:
            reasons.append(f"same step time as the next ({runner_up.layout.describe()}), with less or equal traffic")
    return reasons
