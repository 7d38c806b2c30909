"""The acceptance dimensions judged from run artifacts, as plain functions (read through training/run_output.py).

Every check returns a `DimensionResult`: passed or not, its named figures (typed, what other steps read), the
measured detail, the threshold, the evidence (files, steps), and when it fails, what to look at first. Which
dimensions a report holds, and how each is run, is the check table's (tasks/acceptance/checks.py).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from training.config import StrictModel
from training.layout import MESH_DIMS, MESH_GROUPS, Layout
from training.run_output import RANKS, ParamPiece, ParamRecord, RunOutput, StepRecord
from validation.resources import ResourceLimits, resource_gate

if TYPE_CHECKING:  # the re-check reads checkpoint records (torch); reading a report must not load it
    from validation.checkpoint_interval import IntervalCheck


class AcceptanceThresholds(StrictModel):
    """Pass thresholds of the acceptance dimensions."""

    correctness_max_rel_deviation: float | None = Field(
        default=None,
        gt=0,
        description="Largest relative deviation of the distributed run (fp32, no dropout) from the independent "
        "reference over acceptance.reference_steps, of each step's loss and gradient norm and of the parameters "
        "after the last step. None (the default): derived from this job's measured clean noise, "
        "correctness_noise_factor x how far the reference's noise twin (the same steps in the distributed job's "
        "summation order) strays from the reference, at least that factor x the fp32 epsilon; a value overrides it.",
    )
    correctness_noise_factor: float = Field(
        default=30.0,
        gt=1,
        le=1e6,
        description="The correctness tolerance as a multiple of the measured clean noise. Clean distributed runs "
        "deviate by up to about 3x the noise twin's deviation (tests/integration/parallel/"
        "test_correctness_faults.py prints it per layout); model-parallel faults by 100x or more.",
    )
    scaling_efficiency_min: float = Field(
        default=0.7, gt=0, le=1.5, description="Smallest T_N / (N * T_1) (throughput of N ranks vs one)."
    )
    comm_share_max: float = Field(default=0.5, gt=0, le=1, description="Largest share of step time in communication.")
    straggler_ratio_max: float = Field(
        default=1.25,
        gt=1,
        description="Largest ratio of a rank's median compute time per step to the median of the other ranks' "
        "(a rank above it is a straggler the others wait for). Compute time is the device's (CUDA events) on GPUs "
        "and the process's CPU time on CPU, which a busy shared host does not inflate; wall time only for runs "
        "that recorded neither.",
    )
    gpu_utilization_min: float = Field(default=0.7, gt=0, le=1, description="GPUs: smallest mean utilisation.")
    device_busy_min: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="GPUs: smallest device busy share of a rank, the CUDA events around its compute over its step "
        "time (validation/resources.py); None = off until measured on this project's GPU runs.",
    )
    compute_share_min: float | None = Field(
        default=0.7,
        gt=0,
        le=1,
        description="CPU runs: smallest compute share of a rank, the median over steps of compute / (compute + data "
        "wait) wall time (validation/resources.py): an idle data loader trips it; None = off.",
    )
    sm_active_min: float | None = Field(
        default=None, gt=0, le=1, description="GPUs: smallest SM activity (DCGM) where measured; None = off."
    )
    mfu_min: float | None = Field(
        default=None, gt=0, le=1, description="GPUs: smallest model FLOPs utilisation where measured; None = off."
    )
    gpu_memory_max: float = Field(default=0.9, gt=0, le=1, description="GPUs: largest share of device memory used.")
    loss_spike_factor: float = Field(default=3.0, gt=1, description="A loss above factor x recent median is a spike.")
    loss_spike_window_steps: int = Field(default=10, ge=2, description="Steps in the median a spike is judged by.")
    stall_timeout_s: float = Field(default=300.0, gt=0, description="No step progress for this long is a hang.")
    warmup_steps_ignored: int = Field(default=2, ge=0, description="First steps left out of throughput figures.")
    plan_max_rel_error: float = Field(
        default=0.5,
        gt=0,
        le=100,
        description="Plan vs run: largest |planned - measured| / measured of the step time and of each rank's peak "
        "memory that counts as agreement (the acceptance report's `plan_accuracy`; shown, never failing a "
        "dimension).",
    )
    plan_finding_runs: int = Field(
        default=3,
        ge=1,
        le=100,
        description="Plan vs run: a figure beyond plan_max_rel_error on the same side in this many accepted runs "
        "in a row (this one and the ledger's last ones on the accelerator and layout) is a planner finding.",
    )
    quality_max_rel_worse: float = Field(
        default=0.02,
        gt=0,
        le=10,
        description="Quality gate with a baseline: largest relative excess of the run's final validation loss, "
        "and of its mean training loss over the last 10% of steps, over the baseline's (0.02 = 2% worse).",
    )
    quality_min_loss_drop_fraction: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="Quality gate before a baseline exists: the final validation loss must be at most "
        "(1 - this) x the first step's training loss.",
    )
    bus_bandwidth_gbps_min: float | None = Field(
        default=None,
        gt=0,
        description="Connectivity: smallest all-reduce bus bandwidth in GB/s (nccl-tests' busbw of the largest "
        "run.comm_probe_mb message, training/comm_probe.py), to compare with the links' speed; None = report only.",
    )
    host_pair_bandwidth_ratio_min: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Connectivity: smallest ratio of the slowest host pair's ping-pong bandwidth to the median "
        "pair's (one slow link or NIC among equal ones; needs 3 or more hosts to tell anything, since with 2 the "
        "one pair is its own median); None = report only.",
    )


class Figures(BaseModel):
    """A dimension's named figures: what other steps (the ledger, the drills) read of its verdict, by attribute.

    The report file keeps them among the dimension's `measured` values (where reports always had them), so a
    report reads back, an older one included, with its figures typed (`of`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dimension: ClassVar[str]
    """The dimension whose figures these are."""

    @classmethod
    def of(cls, measured: Any) -> Self | None:
        """The figures among a dimension's `measured` values as written (fields an older report lacks: None)."""
        if not isinstance(measured, dict):
            return None
        return cls.model_validate({k: v for k, v in measured.items() if k in cls.model_fields})


class ConnectivityFigures(Figures):
    """Connectivity: the world the job formed and the start-up probe's all-reduce bus bandwidth."""

    dimension: ClassVar[str] = "connectivity"

    world_size: int | None = Field(default=None, description="Ranks that joined the job (ranks.json).")
    busbw_gbps: float | None = Field(
        default=None, description="All-reduce bus bandwidth of the largest probe message, GB/s (None: probe off)."
    )
    busbw_timed_s: float | None = Field(
        default=None, description="Seconds the probe's timed all-reduces of that size took in all."
    )

    @classmethod
    def of(cls, measured: Any) -> Self | None:
        """As `Figures.of`; a report from before the bus bandwidth was a figure has it under comm_probe only."""
        if isinstance(measured, dict) and "busbw_gbps" not in measured and isinstance(measured.get("comm_probe"), dict):
            probe = measured["comm_probe"]
            measured = {**measured, "busbw_gbps": probe.get("busbw_gbps"), "busbw_timed_s": probe.get("busbw_timed_s")}
        return super().of(measured)


class PerformanceFigures(Figures):
    """Performance: throughput, its timing intervals, the communication share and the slowest rank."""

    dimension: ClassVar[str] = "performance"

    scaling_efficiency: float | None = Field(default=None, description="T_N / (N * T_1).")
    tokens_per_s: float | None = Field(default=None, description="Steady-state tokens/s of all ranks (rank 0's).")
    tokens_per_s_per_rank: float | None = Field(default=None, description="tokens_per_s / the world size.")
    tokens_per_cpu_s: float | None = Field(
        default=None, description="Tokens per CPU-second of the slowest rank (CPU runs; None: not recorded)."
    )
    step_cpu_s: float | None = Field(default=None, description="Median CPU time of a step (the slowest rank's).")
    timed_s: float | None = Field(default=None, description="Seconds the steady-state steps took in all, wall.")
    cpu_timed_s: float | None = Field(default=None, description="The same steps' CPU seconds in all.")
    reference_tokens_per_s: float | None = Field(default=None, description="The one-process reference's tokens/s.")
    comm_share: float | None = Field(default=None, description="Largest rank's share of step time in communication.")
    slow_rank: int | None = Field(default=None, description="The straggler named first (None: none).")
    slow_host: str | None = Field(default=None, description="Its host, where ranks.json tells it.")
    layout: str | None = Field(default=None, description='The layout in words ("dp4 (ddp)").')


class RecoveryFigures(Figures):
    """Recovery: where the relaunched job resumed and how its losses compared."""

    dimension: ClassVar[str] = "recovery"

    resumed_from_step: int | None = Field(default=None, description="The step it resumed from (None: it did not).")
    steps_compared: int | None = Field(default=None, description="Steps after the resume compared with the reference.")
    first_mismatch: int | None = Field(default=None, description="The first step whose loss differed (None: none).")


FIGURES: dict[str, type[Figures]] = {f.dimension: f for f in (ConnectivityFigures, PerformanceFigures, RecoveryFigures)}
"""Dimension name -> the model of its named figures (dimensions without one have only `measured`)."""

F = TypeVar("F", bound=Figures)


@dataclass(kw_only=True)
class DimensionResult:
    """One dimension's verdict: passed, failed, or not measured (`passed` None: nothing to judge it by)."""

    name: str
    passed: bool | None
    measured: Any = None
    """What was measured, for people and the report (the figures among it)."""
    threshold: Any = None
    evidence: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    look_first: str = ""
    figures: Figures | None = None
    """The dimension's named figures (FIGURES); read back from `measured` where not given."""

    def __post_init__(self) -> None:
        if self.figures is not None:
            self.measured = {**self.figures.model_dump(), **(self.measured or {})}
        elif self.name in FIGURES:
            self.figures = FIGURES[self.name].of(self.measured)

    @property
    def status(self) -> str:
        """passed, failed or not measured."""
        return {True: "passed", False: "failed", None: "not measured"}[self.passed]

    @classmethod
    def not_measured(cls, name: str, why: str, look_first: str = "") -> DimensionResult:
        """A dimension that could not be measured (not a failure of its own: `why` names the finding that is)."""
        return cls(name=name, passed=None, message=f"not measured: {why}", look_first=look_first)

    def figures_as(self, kind: type[F]) -> F:
        """Its figures, of `kind`: what its dimension's check always sets (an internal invariant)."""
        assert isinstance(self.figures, kind), (self.name, self.figures)
        return self.figures

    def to_json(self) -> dict[str, Any]:
        """As a dict, with its status (the figures are among `measured`)."""
        return {**{k: v for k, v in asdict(self).items() if k != "figures"}, "status": self.status}


def figures_of(dimensions: list[DimensionResult], kind: type[F]) -> F | None:
    """The figures of type `kind` among `dimensions` (None: no dimension measured them)."""
    return next((d.figures for d in dimensions if isinstance(d.figures, kind)), None)


def rank_metrics(output_dir: Path) -> dict[int, dict[int, StepRecord]]:
    """rank -> step -> metrics record."""
    return RunOutput(output_dir).all_metrics()


# ---- connectivity ---------------------------------------------------------------------------


def check_connectivity(
    output_dir: Path, expected_world: int, limits: AcceptanceThresholds | None = None
) -> DimensionResult:
    """World size, ranks 0..N-1 once each, local ranks consistent per host, collectives right; with the start-up
    communication probe (run.comm_probe_mb) its bus bandwidth and host pairs, judged by `limits` where set."""
    path, record = output_dir / RANKS, RunOutput(output_dir).ranks()
    if record is None:
        return DimensionResult(
            name="connectivity", passed=False, threshold=expected_world, evidence={"file": str(path)},
            message=f"{RANKS} was never written",
            look_first="the job did not get through rendezvous: check the node checks (ports, hostnames) and the job "
            "log",
        )  # fmt: skip
    ranks = record.ranks
    problems = []
    if record.world_size != expected_world:
        problems.append(f"world size {record.world_size}, the spec says {expected_world}")
    seen = sorted(r["rank"] for r in ranks)
    if seen != list(range(expected_world)):
        problems.append(f"ranks {seen}, expected each of 0..{expected_world - 1} once")
    by_host: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        by_host[r["host"]].append(r["local_rank"])
    for host, local in by_host.items():
        if sorted(local) != list(range(len(local))):
            problems.append(f"host {host} has local ranks {sorted(local)}")
    bad_collectives = [
        r["rank"]
        for r in ranks
        if r.get("collective") is None
        or r["collective"]["all_reduce_sum"] != r["collective"]["all_reduce_expected"]
        or not r["collective"]["broadcast_ok"]
    ]
    if bad_collectives:
        problems.append(f"collective sanity check wrong on ranks {bad_collectives}")
    mesh = mesh_problems(ranks, expected_world)
    problems += mesh.problems
    bandwidth = bandwidth_findings(ranks, limits or AcceptanceThresholds())
    problems += bandwidth.problems
    probe = bandwidth.measured or {}
    figures = ConnectivityFigures(
        world_size=record.world_size, busbw_gbps=probe.get("busbw_gbps"), busbw_timed_s=probe.get("busbw_timed_s")
    )
    measured: dict[str, Any] = {"hosts": {h: len(v) for h, v in by_host.items()}}
    if bandwidth.measured is not None:
        measured["comm_probe"] = bandwidth.measured
    evidence: dict[str, Any] = {"file": str(path), "backend": sorted({r["backend"] for r in ranks})}
    if mesh.dims is not None:
        measured["mesh"] = {"dims": mesh.dims, "groups_checked": mesh.groups_checked}
        evidence["coords"] = mesh.coords
    look = "the rendezvous and the network: node-check findings on ports and hostname resolution"
    if mesh.problems:
        look = "the device mesh (training/mesh.py) and the sub-group named first, then " + look.removeprefix("the ")
    elif bandwidth.problems and len(bandwidth.problems) == len(problems):
        look = "the interconnect: the slowest host pair's NICs, cabling and switch ports, then the NCCL/gloo " + (
            "network interface chosen (cluster.network)"
        )
    threshold: dict[str, Any] = {"world_size": expected_world}
    if limits is not None:
        threshold |= {
            "bus_bandwidth_gbps_min": limits.bus_bandwidth_gbps_min,
            "host_pair_bandwidth_ratio_min": limits.host_pair_bandwidth_ratio_min,
        }
    return DimensionResult(
        name="connectivity",
        passed=not problems,
        figures=figures,
        measured=measured,
        threshold=threshold,
        evidence=evidence,
        message="; ".join(problems),
        look_first=look if problems else "",
    )


@dataclass
class BandwidthCheck:
    """What rank 0's comm_probe record showed (measured None: the probe was off)."""

    measured: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)


def _pair_name(pair: dict[str, Any]) -> str:
    a, b = pair["hosts"]
    return f"{a}<->{b} at {pair['bandwidth_gbps']:.3g} GB/s"


def bandwidth_findings(ranks: list[dict[str, Any]], limits: AcceptanceThresholds) -> BandwidthCheck:
    """Rank 0's start-up communication probe (training/comm_probe.py): the all-reduce bus bandwidth per size and
    of the largest, each host pair's bandwidth, the slowest pair and its ratio to the median pair, against
    bus_bandwidth_gbps_min and host_pair_bandwidth_ratio_min (None: reported only)."""
    probe = next((r.get("comm_probe") for r in ranks if r["rank"] == 0), None)
    check = BandwidthCheck()
    wanted = limits.bus_bandwidth_gbps_min is not None or limits.host_pair_bandwidth_ratio_min is not None
    if probe is None:
        if wanted:
            check.problems.append("no comm_probe record in ranks.json to judge bandwidth by: set run.comm_probe_mb")
        return check
    pairs = probe["pairs"]
    slowest = min(pairs, key=lambda p: p["bandwidth_gbps"], default=None)
    median = statistics.median(p["bandwidth_gbps"] for p in pairs) if pairs else None
    ratio = slowest["bandwidth_gbps"] / median if slowest is not None and median else None
    largest = max(probe["sizes"], key=lambda s: s["bytes"])
    iters = probe.get("timed_iters")
    check.measured = {
        "busbw_gbps": probe["busbw_gbps"],
        "busbw_timed_s": largest["time_s"] * iters if isinstance(iters, int) else None,
        "sizes": [{k: s[k] for k in ("bytes", "time_s", "algbw_gbps", "busbw_gbps")} for s in probe["sizes"]],
        "pairs": {"<->".join(p["hosts"]): p["bandwidth_gbps"] for p in pairs},
        "slowest_pair": None if slowest is None else list(slowest["hosts"]),
        "slowest_pair_ratio_to_median": ratio,
    }
    where = f"; slowest host pair {_pair_name(slowest)}" if slowest is not None else " (one host, no host pairs)"
    low = limits.bus_bandwidth_gbps_min
    if low is not None and probe["busbw_gbps"] < low:
        check.problems.append(
            f"all-reduce bus bandwidth {probe['busbw_gbps']:.3g} GB/s ({largest['bytes']} bytes) below "
            f"bus_bandwidth_gbps_min={low:g}{where}"
        )
    least = limits.host_pair_bandwidth_ratio_min
    if least is not None and slowest is not None and ratio is not None and ratio < least:
        check.problems.append(
            f"slowest host pair {_pair_name(slowest)} is {ratio:.2f} x the median pair ({median:.3g} GB/s), "
            f"below host_pair_bandwidth_ratio_min={least:g}"
        )
    return check


@dataclass
class MeshCheck:
    """What the ranks' mesh records showed (dims None: a data-parallel layout, which records no mesh)."""

    dims: dict[str, int] | None = None
    coords: dict[int, dict[str, int]] = field(default_factory=dict)
    groups_checked: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _dp_rank(coords: dict[str, int], dims: dict[str, int]) -> int:
    return coords["dp_replicate"] * dims["dp_shard"] + coords["dp_shard"]


def _same_place(group: str, a: dict[str, int], b: dict[str, int], dims: dict[str, int]) -> bool:
    """Ranks with coordinates `a` and `b` belong to one `group` sub-group: equal on every other dimension (for
    ep also the same block of ep consecutive data-parallel ranks)."""
    free = MESH_GROUPS[group]
    if group == "ep":
        block = {_dp_rank(a, dims) // dims["ep"], _dp_rank(b, dims) // dims["ep"]}
        return all(a[d] == b[d] for d in ("pp", "cp", "tp")) and len(block) == 1
    return all(a[d] == b[d] for d in MESH_DIMS if d not in free)


def mesh_problems(ranks: list[dict[str, Any]], world: int) -> MeshCheck:
    """The mesh records of a model-parallel job (ranks.json `mesh`): every coordinate once, the degrees' product
    the world size, each sub-group's ranks those that share every other coordinate, every sub-group's all-reduce
    right. A job whose ranks record no mesh (a data-parallel layout) has nothing to check here."""
    meshed = {r["rank"]: r["mesh"] for r in ranks if r.get("mesh")}
    check = MeshCheck()
    if not meshed:
        return check
    if len(meshed) != len(ranks):
        missing = sorted(r["rank"] for r in ranks if not r.get("mesh"))
        check.problems.append(f"{_ranks_text(missing)} recorded no mesh coordinates while the others did")
    dims_seen = {json_key(m["dims"]) for m in meshed.values()}
    first = min(meshed)
    dims = check.dims = dict(meshed[first]["dims"])
    if len(dims_seen) > 1:
        check.problems.append(f"the ranks disagree on the mesh degrees: {sorted(dims_seen)}")
    product = math.prod(dims[d] for d in MESH_DIMS)
    if product != world:
        shape = " x ".join(f"{d}{dims[d]}" for d in MESH_DIMS)
        check.problems.append(f"mesh {shape} has {product} places for {world} ranks")
    by_place: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for rank, mesh in sorted(meshed.items()):
        coords = check.coords[rank] = {d: int(mesh["coords"][d]) for d in (*MESH_DIMS, "ep") if d in mesh["coords"]}
        by_place[tuple(coords.get(d, -1) for d in MESH_DIMS)].append(rank)
        outside = [d for d in MESH_DIMS if not 0 <= coords.get(d, -1) < dims[d]]
        if outside:
            check.problems.append(f"rank {rank}: coordinates {coords} outside the mesh on {', '.join(outside)}")
    for place, holders in by_place.items():
        if len(holders) > 1:
            shown = dict(zip(MESH_DIMS, place, strict=True))
            check.problems.append(f"{_ranks_text(holders)} all claim the mesh place {shown}")
    for rank, mesh in sorted(meshed.items()):
        for group, record in sorted((mesh.get("groups") or {}).items()):
            if group not in MESH_GROUPS:
                continue
            check.groups_checked[group] = check.groups_checked.get(group, 0) + 1
            expected = sorted(
                other for other, c in check.coords.items() if _same_place(group, check.coords[rank], c, dims)
            )
            if sorted(record["ranks"]) != expected:
                check.problems.append(
                    f"rank {rank}: its {group} group is ranks {sorted(record['ranks'])}, its coordinates "
                    f"{check.coords[rank]} put ranks {expected} in it"
                )
            if record["all_reduce_sum"] != record["all_reduce_expected"]:
                check.problems.append(
                    f"rank {rank}: the all-reduce over its {group} group (ranks {sorted(record['ranks'])}) gave "
                    f"{record['all_reduce_sum']}, expected {record['all_reduce_expected']}"
                )
        sized = {g for g, free in MESH_GROUPS.items() if math.prod(dims.get(d, 1) for d in free) > 1}
        missed = sorted(sized - set(mesh.get("groups") or {}))
        if missed:
            check.problems.append(f"rank {rank}: no collective recorded on its {', '.join(missed)} group(s)")
    check.problems += placement_problems(meshed, check.coords, dims)
    return check


def _layers_text(layers: list[int]) -> str:
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(str(x) for x in layers)


def placement_problems(
    meshed: dict[int, dict[str, Any]], coords: dict[int, dict[str, int]], dims: dict[str, int]
) -> list[str]:
    """Every layer of the model (its n_layers, from the spec) runs on exactly one stage of each pipeline, and every
    expert of each MoE layer on exactly one rank of each expert-parallel group, by what the ranks recorded they
    hold (ranks.json mesh `layers`, `experts`; runs from before they were recorded have nothing to check)."""
    if not all("layers" in m for m in meshed.values()):
        return []
    problems: list[str] = []
    pipelines: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for rank in sorted(meshed):
        pipelines[tuple(coords[rank][d] for d in MESH_DIMS if d != "pp")].append(rank)
    wrong: dict[str, list[list[int]]] = defaultdict(list)
    for ranks in pipelines.values():
        n_layers = meshed[ranks[0]]["n_layers"]
        runs_on: dict[int, list[int]] = defaultdict(list)
        for rank in ranks:
            for layer in meshed[rank]["layers"]:
                runs_on[layer].append(coords[rank]["pp"])
        findings = []
        missing = [x for x in range(n_layers) if not runs_on.get(x)]
        if missing:
            findings.append(f"{_layers_text(missing)} of {n_layers} run(s) on no pipeline stage")
        findings += [f"layer {x} runs on stages {sorted(s)}" for x, s in sorted(runs_on.items()) if len(s) > 1]
        extra = sorted(x for x in runs_on if not 0 <= x < n_layers)
        if extra:
            findings.append(f"{_layers_text(extra)} beyond the model's {n_layers}")
        if findings:
            split = " | ".join(
                f"stage {coords[r]['pp']}: {_layers_text(meshed[r]['layers'])}"
                for r in sorted(ranks, key=lambda r: coords[r]["pp"])
            )
            wrong[f"the pipeline split is wrong: {'; '.join(findings)} ({split})"].append(ranks)
    ep = dims.get("ep", 1)
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for rank in sorted(meshed):
        c = coords[rank]
        groups[(c["pp"], c["cp"], c["tp"], _dp_rank(c, dims) // ep)].append(rank)
    for ranks in groups.values():
        n_experts = meshed[ranks[0]].get("n_experts", 0)
        held: dict[tuple[int, int], list[int]] = defaultdict(list)
        layers = {int(x) for r in ranks for x in (meshed[r].get("experts") or {})}
        for rank in ranks:
            for layer, experts in (meshed[rank].get("experts") or {}).items():
                for expert in experts:
                    held[(int(layer), expert)].append(rank)
        findings = []
        for layer in sorted(layers):
            missing = [e for e in range(n_experts) if not held.get((layer, e))]
            if missing:
                findings.append(f"experts {missing} of layer {layer} run on no rank")
            findings += [
                f"expert {e} of layer {layer} runs on {_ranks_text(sorted(held[(layer, e)]))}"
                for e in range(n_experts)
                if len(held.get((layer, e), [])) > 1
            ]
        if findings:
            wrong[f"the experts are misplaced over expert parallelism: {'; '.join(findings)}"].append(ranks)
    for finding, where in wrong.items():
        problems.append(f"{finding}; in the group(s) of ranks {', '.join(str(r) for r in where)}")
    return problems


def mesh_of(output_dir: Path, world: int) -> MeshCheck | None:
    """The mesh the job's ranks recorded in ranks.json (None: no ranks.json, or a data-parallel layout)."""
    record = RunOutput(output_dir).ranks()
    if record is None:
        return None
    check = mesh_problems(record.ranks, world)
    return check if check.dims is not None else None


def json_key(value: Any) -> str:
    """A stable text form of a JSON value (to compare records)."""
    return json.dumps(value, sort_keys=True)


# ---- correctness ----------------------------------------------------------------------------

CLEAN_REL_DEVIATION = 1e-7
"""The largest relative deviation of clean runs from the reference that benchmarks/acceptance_noise.py measured
(2 CPU ranks, gloo, fp32, grad_accum_steps 2; the tiny and the embedded default's model, 10 steps): the noise
assumed for a reference that recorded no noise twin (runs from before it did)."""

FP32_EPS = 2.0**-23
"""The float32 machine epsilon: the least noise a tolerance assumes (a twin may happen to agree exactly)."""


def _rel(value: float | None, reference: float | None) -> float:
    """|value - reference| / |reference| (NaN where either is missing; inf where the value is not finite)."""
    if value is None or reference is None:
        return math.nan
    if not math.isfinite(value):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-30)


@dataclass
class Comparison:
    """One figure of the distributed run against the reference: its worst relative deviation and where (a step or
    a parameter), the clean noise measured for it, and the tolerance that noise gives."""

    figure: str
    deviation: float
    where: Any
    noise: float
    tolerance: float
    first_bad: Any = None
    per_item: dict[Any, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every item within the tolerance."""
        return self.first_bad is None

    @property
    def margin(self) -> float:
        """The worst deviation in tolerances (a fault should stand far above 1, a clean run far below)."""
        return self.deviation / self.tolerance

    def to_json(self) -> dict[str, Any]:
        """The figures, without the per-item table."""
        return {"max_rel_deviation": self.deviation, "where": self.where, "clean_noise": self.noise,
                "tolerance": self.tolerance, "margin": self.margin, "first_failing": self.first_bad}  # fmt: skip


def _compare(figure: str, deviations: dict[Any, float], noise: float, tolerance: float) -> Comparison:
    finite = {k: v for k, v in deviations.items() if not math.isnan(v)}
    worst = max(finite, key=lambda k: finite[k], default=None)
    first_bad = next((k for k, v in finite.items() if not v <= tolerance), None)
    value = finite[worst] if worst is not None else math.nan
    return Comparison(figure, value, worst, noise, tolerance, first_bad, finite)


def whole_parameters(pieces: list[ParamPiece], tied: dict[str, str] | None = None) -> dict[str, tuple[float, float]]:
    """Parameter name -> (sum of squares, sum) of the whole parameter from its distinct pieces (a piece that
    several ranks hold counts once; a tied name counts under the name it is tied to)."""
    seen: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    whole: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for piece in pieces:
        name = (tied or {}).get(piece.name, piece.name)
        key = (name, tuple(piece.offset), tuple(piece.shape))
        if key in seen:
            continue
        seen.add(key)
        whole[name][0] += piece.sq_sum
        whole[name][1] += piece.sum
    return {name: (sq, total) for name, (sq, total) in whole.items()}


def _param_deviation(value: tuple[float, float], reference: tuple[float, float], numel: int) -> float:
    """How far a whole parameter is from the reference's: the larger of its norm's relative deviation and its
    sum's deviation relative to the largest a sum of numbers of that norm can be (sqrt(numel) x norm)."""
    (sq, total), (ref_sq, ref_total) = value, reference
    norm, ref_norm = math.sqrt(sq), math.sqrt(ref_sq)
    if ref_norm == 0:
        return 0.0 if norm == 0 else math.inf
    return max(abs(norm - ref_norm) / ref_norm, abs(total - ref_total) / (math.sqrt(max(numel, 1)) * ref_norm))


@dataclass
class ReplicaCheck:
    """Whether every parameter piece that two or more ranks hold (replicas over TP, DP replicas, tied copies) is
    bit-identical on all of them at the end of the run."""

    pieces_checked: int = 0
    mismatched: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    max_rel_difference: float = 0.0
    """Over the mismatched pieces, the largest (max - min) / max of their replicas' norms (0: only the bits)."""

    def to_json(self) -> dict[str, Any]:
        """The figures and the first mismatched pieces."""
        return {"pieces_checked": self.pieces_checked, "mismatched": len(self.mismatched),
                "max_rel_difference": self.max_rel_difference, "first_mismatched": self.mismatched[:5]}  # fmt: skip


def replica_problems(records: dict[int, ParamRecord], coords: dict[int, dict[str, int]] | None = None) -> ReplicaCheck:
    """Every parameter piece held by two or more ranks (the same name, global offset and shape: what the layout
    replicates) bit-identical on all of them, and every parameter's pieces covering it whole. `coords` (the mesh
    records, rank -> coordinates) name the mesh dimensions a mismatched piece is replicated over."""
    check = ReplicaCheck()
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, ParamPiece]]] = defaultdict(list)
    sizes: dict[str, int] = {}
    for rank, record in sorted(records.items()):
        for piece in record.pieces:
            name = record.tied.get(piece.name, piece.name)
            holders[(name, tuple(piece.offset), tuple(piece.shape))].append((rank, piece))
            sizes[name] = math.prod(piece.full_shape)
    covered: dict[str, int] = defaultdict(int)
    for (name, _, shape), held in holders.items():
        covered[name] += math.prod(shape)
        if len(held) < 2:
            continue
        check.pieces_checked += 1
        if len({p.sha256 for _, p in held}) == 1:
            continue
        norms = [math.sqrt(p.sq_sum) for _, p in held]
        spread = (max(norms) - min(norms)) / max(max(norms), 1e-30)
        check.max_rel_difference = max(check.max_rel_difference, spread)
        ranks = sorted({r for r, _ in held})
        over = sorted({d for d in MESH_DIMS if coords and len({coords.get(r, {}).get(d) for r in ranks}) > 1})
        # The dimension a difference lies along: two ranks with other bits that differ in that coordinate only.
        differs = sorted({
            d for (a, pa), (b, pb) in itertools.combinations(held, 2) if pa.sha256 != pb.sha256 and coords
            for d in MESH_DIMS if coords.get(a, {}).get(d) != coords.get(b, {}).get(d)
            and all(coords.get(a, {}).get(o) == coords.get(b, {}).get(o) for o in MESH_DIMS if o != d)
        })  # fmt: skip
        names = sorted({p.name for _, p in held})
        check.mismatched.append({"parameter": " = ".join(names), "offset": list(held[0][1].offset), "ranks": ranks,
                                 "replicated_over": over, "differs_over": differs,
                                 "rel_difference": spread})  # fmt: skip
    if check.mismatched:
        first = check.mismatched[0]
        along = first["differs_over"] or first["replicated_over"]
        over = f" (the replicas differ over {', '.join(along)})" if along else ""
        more = len(check.mismatched) - 1
        check.problems.append(
            f"replicas differ at the end of the run: {first['parameter']} on {_ranks_text(first['ranks'])}{over}, "
            f"norms {first['rel_difference']:.3g} apart (relative)"
            + (f", and {more} more replicated piece(s)" if more else "")
            + f"; largest difference {check.max_rel_difference:.3g}"
        )
    gaps = sorted(name for name, size in sizes.items() if covered[name] != size)
    if gaps:
        check.problems.append(
            f"parameter {gaps[0]}: the ranks' pieces hold {covered[gaps[0]]} of its {sizes[gaps[0]]} values"
            + (f" (and {len(gaps) - 1} more parameters)" if len(gaps) > 1 else "")
        )
    return check


_Figure = Callable[[StepRecord], float | None]
_COMPARED_FIGURES: tuple[tuple[str, _Figure, _Figure], ...] = (
    ("loss", lambda r: r.loss, lambda r: r.twin_loss),
    ("gradient norm", lambda r: r.grad_norm, lambda r: r.twin_grad_norm),
)
"""The per-step figures correctness compares with the reference: (name, the figure, the reference's noise twin's)."""


def check_correctness(
    distributed: dict[int, StepRecord],
    reference: dict[int, StepRecord],
    max_rel: float | None = None,
    *,
    noise_factor: float = 30.0,
    params: dict[int, ParamRecord] | None = None,
    reference_params: ParamRecord | None = None,
    replicas: dict[str, ReplicaCheck] | None = None,
) -> DimensionResult:
    """The distributed run against the independent reference (same data, seed, global batch): every step's loss
    and gradient norm, and the whole parameters after the last step where both runs ended there (`params`, every
    rank's record, and `reference_params`), each within its tolerance; and `replicas` (run label -> its replica
    check) without a mismatch.

    A tolerance is `max_rel` where given, else noise_factor x this job's clean noise: how far the reference's noise
    twin strayed from it over the same steps on the same figure (at least the fp32 epsilon; the benchmarks' figure
    CLEAN_REL_DEVIATION for a reference that recorded no twin).
    """
    steps = sorted(set(distributed) & set(reference))

    def tolerance(noise: float) -> float:
        return max_rel if max_rel is not None else noise_factor * max(noise, FP32_EPS)

    if not steps:
        return DimensionResult(
            name="correctness", passed=False, threshold={"max_rel_deviation": max_rel},
            message="no common steps to compare", look_first="the two runs' metrics",
        )  # fmt: skip
    comparisons: list[Comparison] = []
    for figure, value, twin_value in _COMPARED_FIGURES:
        deviations = {s: _rel(value(distributed[s]), value(reference[s])) for s in steps}
        twin = [_rel(twin_value(reference[s]), value(reference[s])) for s in steps]
        noise = max((t for t in twin if math.isfinite(t)), default=CLEAN_REL_DEVIATION)
        if any(not math.isnan(d) for d in deviations.values()) or figure == "loss":
            comparisons.append(_compare(figure, deviations, noise, tolerance(noise)))
    params_note = "not compared: no params records"
    if params and reference_params is not None:
        ended = {r.step for r in params.values()}
        if ended != {reference_params.step}:
            params_note = f"not compared: the run ended at step {sorted(ended)}, the reference at {reference_params.step}"
        else:
            tied = next(iter(params.values())).tied
            mine = whole_parameters([p for r in params.values() for p in r.pieces], tied)
            ref = whole_parameters(reference_params.pieces, reference_params.tied)
            numel = {p.name: math.prod(p.full_shape) for p in reference_params.pieces}
            twin = whole_parameters(reference_params.twin, reference_params.tied)
            deviations = {n: _param_deviation(mine[n], ref[n], numel[n]) if n in mine else math.inf for n in ref}
            noises = [_param_deviation(twin[n], ref[n], numel[n]) for n in ref if n in twin]
            noise = max(noises, default=CLEAN_REL_DEVIATION)
            comparisons.append(_compare(f"parameters after step {reference_params.step}", deviations, noise,
                                        tolerance(noise)))  # fmt: skip
            params_note = "compared"
    failures = [c for c in comparisons if not c.passed]
    loss = comparisons[0]
    problems = []
    for c in failures:
        at = f"step {c.where}" if isinstance(c.where, int) else c.where
        first = f"step {c.first_bad}" if isinstance(c.first_bad, int) else c.first_bad
        problems.append(
            f"{c.figure} deviates from the reference by {c.deviation:.3g} (relative) at {at}, {c.margin:.3g}x the "
            f"tolerance {c.tolerance:.3g} (clean noise {c.noise:.3g}); first beyond it: {first}"
        )
    for label, check in (replicas or {}).items():
        problems += [f"{label} run: {p}" for p in check.problems]
    look = []
    if any(check.mismatched for check in (replicas or {}).values()):
        look.append(
            "the gradient reduction of the replicated parameters named, over the dimension named (a replicated "
            "weight whose gradient is not all-reduced over its group: sequence-parallel norms over tp), and that "
            "every replica steps the same optimizer state"
        )
    if any(c.figure == "gradient norm" for c in failures) or any(c.figure.startswith("param") for c in failures):
        look.append(
            "gradient scaling and clipping: the norm's reduction over every mesh dimension (training/grad_clip.py), "
            "gradient divide factors (expert parallelism), loss scaling"
        )
    if not loss.passed:
        look.append("data order and seeds per rank (sampler records), then gradient accumulation and sync")
    margin = max((c.margin for c in comparisons if math.isfinite(c.margin)), default=math.nan)
    measured: dict[str, Any] = {
        "max_rel_deviation": loss.deviation,
        "worst_step": loss.where,
        "figures": {c.figure: c.to_json() for c in comparisons},
        "margin": margin,
        "replicas": {label: check.to_json() for label, check in (replicas or {}).items()},
    }
    threshold = {
        "max_rel_deviation": loss.tolerance,
        "source": "acceptance.thresholds.correctness_max_rel_deviation" if max_rel is not None else "measured noise",
        "noise_factor": None if max_rel is not None else noise_factor,
        "clean_rel_deviation_measured": loss.noise,
        "tolerances": {c.figure: c.tolerance for c in comparisons},
        "replicas": "bit-identical",
    }
    return DimensionResult(
        name="correctness",
        passed=not problems,
        measured=measured,
        threshold=threshold,
        evidence={"steps_compared": [steps[0], steps[-1]], "first_failing_step": loss.first_bad,
                  "deviation_per_step": loss.per_item, "parameters": params_note},  # fmt: skip
        message="; ".join(problems),
        look_first="; ".join(look),
    )


# ---- performance ----------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


COMPUTE_BASES: tuple[tuple[str, str, Callable[[StepRecord], float | None]], ...] = (
    ("compute_device_s", "device time", lambda r: r.compute_device_s),
    ("compute_cpu_s", "CPU time", lambda r: r.compute_cpu_s),
    ("compute_s", "wall time", lambda r: r.compute_s),
)
"""The per-step compute figures of a metrics record (training/run_output.py) a straggler can be judged by, best
first: the device's own time (CUDA events, GPUs), the process's CPU time (CPU runs), wall time (older runs). A busy
host deschedules its ranks unevenly, which lengthens their wall time but not their CPU or device time."""


def _compute_of(basis: str) -> Callable[[StepRecord], float | None]:
    """The figure of COMPUTE_BASES named `basis`."""
    return next(value for name, _, value in COMPUTE_BASES if name == basis)


def compute_basis(distributed: dict[int, dict[int, StepRecord]], steps: list[int]) -> str:
    """The best figure of COMPUTE_BASES that every rank recorded in every one of `steps` it has a record of."""
    for key, _, value in COMPUTE_BASES[:-1]:
        values = [value(m[s]) for m in distributed.values() for s in steps if s in m]
        if values and all(isinstance(v, int | float) and math.isfinite(v) for v in values):
            return key
    return COMPUTE_BASES[-1][0]


def straggler_ratios(
    distributed: dict[int, dict[int, StepRecord]],
    steps: list[int],
    peers: dict[int, int] | None = None,
    key: str = "compute_s",
) -> dict[int, float]:
    """Per rank, the median over `steps` of its compute time (the record's `key`, see COMPUTE_BASES) divided by
    the median of the OTHER ranks' in the same step; NaN where unknown.

    Against the others, not all ranks: with two ranks the median of all sits halfway and hides a 1.5x rank.
    Per step, then the median: load that slows every rank in a step (a busy host, a shared core) cancels out.
    `peers` (rank -> a role, for a pipeline layout its stage) compares each rank with the ranks of its own role
    only: the stages do different work (the first embeds, the last computes the loss and waits least in the
    bubble), so a stage is no straggler for being another stage; a rank alone in its role has no ratio.
    """
    return {rank: _median(values) for rank, values in _per_step_ratios(distributed, steps, peers, key).items()}


def straggler_floors(
    distributed: dict[int, dict[int, StepRecord]],
    steps: list[int],
    peers: dict[int, int] | None = None,
    key: str = "compute_s",
) -> dict[int, float]:
    """Per rank, the lowest ratio its per-step ratios support: the median less two standard errors of the median
    (from the median absolute deviation: 1.2533 x 1.4826 x MAD / sqrt(n)); NaN where unknown.

    A rank that computes longer in every step (a slower core) has a narrow spread and a floor near its median; a
    rank whose ratio swings from step to step (contention on a shared host, caches cooled by a neighbour) has a
    wide one, and the straggler rule does not flag a ratio its own noise cannot tell from the limit.
    """
    floors = {}
    for rank, values in _per_step_ratios(distributed, steps, peers, key).items():
        if not values:
            floors[rank] = float("nan")
            continue
        middle = _median(values)
        mad = _median([abs(v - middle) for v in values])
        floors[rank] = middle - 2 * 1.2533 * 1.4826 * mad / math.sqrt(len(values))
    return floors


def _per_step_ratios(
    distributed: dict[int, dict[int, StepRecord]], steps: list[int], peers: dict[int, int] | None, key: str
) -> dict[int, list[float]]:
    """Per rank, its compute time in each of `steps` over the median of the other ranks' (of its role) in it."""
    role = peers or {}
    per_step: dict[int, list[float]] = {rank: [] for rank in distributed}
    for step in steps:
        compute = {rank: _compute_of(key)(m[step]) for rank, m in distributed.items() if step in m}
        for rank, value in compute.items():
            others = _median([v for r, v in compute.items() if r != rank and role.get(r) == role.get(rank)])
            if others > 0:
                per_step[rank].append(value / others)
    return per_step


def job_cpu_s(distributed: dict[int, dict[int, StepRecord]], steps: list[int]) -> dict[int, float] | None:
    """step -> the largest process CPU time of a rank in that step (the job moves at its slowest rank's pace);
    None unless every rank recorded cpu_s in every one of `steps` it has."""
    out = {}
    for step in steps:
        values = [m[step].cpu_s for m in distributed.values() if step in m]
        if not values or not all(isinstance(v, int | float) and v > 0 for v in values):
            return None
        out[step] = float(max(values))
    return out or None


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def grad_sync_problem(
    distributed: dict[int, dict[int, StepRecord]], world: int, sharding: str, always_timed: bool | None = None
) -> str | None:
    """What shows that a multi-rank data-parallel job never synchronised gradients, or None.

    Every step of such a job synchronises gradients, so a step whose measured communication time is exactly 0
    had none; DDP and FSDP always measure it (training/metrics.py CommTimer), so no measurement at all is a
    failure too (HSDP with one rank per shard group is not measured: an all-reduce only). `world` is the
    data-parallel degree (the ranks whose gradients are synchronised); `always_timed` overrides the sharding's
    rule (a model-parallel layout's FSDP2 times its all-gathers and reduce-scatters, not a pure replicate's
    all-reduce).
    """
    if world <= 1:
        return None
    timed = sharding != "hsdp" if always_timed is None else always_timed
    unmeasured, silent = [], []
    for rank, metrics in sorted(distributed.items()):
        comm = [m.comm_s for m in metrics.values() if m.comm_s is not None]
        if not comm and timed:
            unmeasured.append(rank)
        zero = sum(1 for c in comm if c == 0)
        if zero:
            silent.append((rank, zero, len(comm)))
    problems = []
    if silent:
        counts = ", ".join(f"{zero} of {n} steps on rank {rank}" for rank, zero, n in silent)
        problems.append(
            f"no gradient synchronisation measured: 0 s of communication in a {world}-rank {sharding} job ({counts})"
        )
    if unmeasured:
        problems.append(
            f"no gradient synchronisation measured: {_ranks_text(unmeasured)} recorded no communication time "
            f"(comm_s) in a {world}-rank {sharding} job"
        )
    return "; ".join(problems) or None


def _mesh_layout(dims: dict[str, int] | None, world: int, sharding: str) -> Layout:
    """The layout the ranks' mesh records show (none recorded: `world` data-parallel ranks)."""
    zero = 0 if sharding == "ddp" else 3
    if not dims:
        return Layout(dp=world, zero=zero, shard_group=world if sharding == "hsdp" else None)
    dp = dims["dp_replicate"] * dims["dp_shard"]
    shard = dims["dp_shard"] if sharding == "hsdp" else None
    return Layout(dp=dp, tp=dims["tp"], pp=dims["pp"], cp=dims["cp"], ep=dims.get("ep", 1), zero=zero,
                  shard_group=shard)  # fmt: skip


def _per_dimension(
    rank0: dict[int, StepRecord], steps: list[int], figure: Callable[[StepRecord], dict[str, float] | None]
) -> dict[str, float]:
    """The median over `steps` of a per-dimension figure (comm_bytes: {"tp": ..., "dp": ...}) of rank 0."""
    values: dict[str, list[float]] = defaultdict(list)
    for s in steps:
        for dim, value in (figure(rank0[s]) or {}).items():
            values[dim].append(float(value))
    return {dim: _median(v) for dim, v in sorted(values.items())}


def check_performance(
    distributed: dict[int, dict[int, StepRecord]],
    reference: dict[int, StepRecord],
    world: int,
    limits: AcceptanceThresholds,
    gpu: dict[str, float] | None = None,
    sharding: str = "ddp",
    mesh: MeshCheck | None = None,
    hosts: dict[int, str] | None = None,
    interval: IntervalCheck | None = None,
) -> DimensionResult:
    """Scaling efficiency, communication share (and GPU utilisation/memory), the resource gates
    (validation/resources.py: compute share, device busy share, memory), gradient synchronisation that
    happened; names a rank that lags (compute time above straggler_ratio_max x the median of the others; device
    or CPU time where the records carry it, see COMPUTE_BASES), and its host where `hosts` (rank -> host name,
    from ranks.json) tells it.

    With a model-parallel `mesh` (connectivity's reading of ranks.json): gradient synchronisation is judged
    over the data-parallel degree, stragglers against the ranks of the same pipeline stage, comm_s is the
    data-parallel collectives' time (the tensor-parallel all-reduces and pipeline sends run inside the
    compute), and per-dimension records (comm_bytes, comm_s_per_dim) are reported as measured.
    """
    skip = limits.warmup_steps_ignored
    dims = mesh.dims if mesh is not None else None
    sync_ranks, timed, peers = world, None, None
    if dims:
        sync_ranks = dims["dp_replicate"] * dims["dp_shard"]
        timed = dims["dp_shard"] > 1  # FSDP2 replicating only (sharding ddp) all-reduces untimed, as HSDP does
        peers = {rank: c["pp"] for rank, c in mesh.coords.items()} if dims["pp"] > 1 else None
    rank0 = distributed.get(0, {})
    steps = [s for s in sorted(rank0) if s > skip]
    ref_steps = [s for s in sorted(reference) if s > skip]
    tokens_n = _median([rank0[s].tokens_per_s for s in steps])
    # The same throughput by CPU time (CPU runs): what the gate compares, since a busy host stretches wall time.
    cpu = job_cpu_s(distributed, steps)
    by_cpu = cpu is not None and all(isinstance(rank0[s].tokens, int | float) for s in steps)
    tokens_cpu = _median([rank0[s].tokens / cpu[s] for s in steps]) if by_cpu else None
    tokens_1 = _median([reference[s].tokens_per_s for s in ref_steps])
    efficiency = tokens_n / (world * tokens_1) if tokens_1 > 0 else float("nan")
    shares = {
        rank: _median(
            [m[s].comm_s / m[s].step_time_s for s in steps if s in m and m[s].comm_s is not None]
        )
        for rank, m in distributed.items()
    }
    comm_share = max((v for v in shares.values() if math.isfinite(v)), default=float("nan"))
    basis = compute_basis(distributed, steps)
    compute = {rank: _median([_compute_of(basis)(m[s]) for s in steps if s in m]) for rank, m in distributed.items()}
    ratios = straggler_ratios(distributed, steps, peers, basis)
    floors = straggler_floors(distributed, steps, peers, basis)
    basis_text = next(text for name, text, _ in COMPUTE_BASES if name == basis)
    data_wait = {
        rank: _median([m[s].data_wait_s / m[s].step_time_s for s in steps if s in m])
        for rank, m in distributed.items()
    }
    failures, look = [], []
    if not (efficiency >= limits.scaling_efficiency_min):
        failures.append(f"scaling efficiency {efficiency:.2f} < {limits.scaling_efficiency_min}")
    if math.isfinite(comm_share) and comm_share > limits.comm_share_max:
        failures.append(f"communication share {comm_share:.2f} > {limits.comm_share_max}")
    no_sync = grad_sync_problem(distributed, sync_ranks, sharding, timed)
    if no_sync:
        failures.append(no_sync)
    resources = resource_gate(distributed, steps, ResourceLimits(
        limits.compute_share_min, limits.device_busy_min, limits.sm_active_min, limits.mfu_min,
        limits.gpu_memory_max), sm_active=(gpu or {}).get("sm_active"), mfu=(gpu or {}).get("mfu"))  # fmt: skip
    failures.extend(resources.failures)
    if gpu:
        if gpu.get("utilization", 1.0) < limits.gpu_utilization_min:
            failures.append(f"GPU utilisation {gpu['utilization']:.2f} < {limits.gpu_utilization_min}")
        if gpu.get("memory_fraction", 0.0) > limits.gpu_memory_max:
            failures.append(f"GPU memory {gpu['memory_fraction']:.2f} > {limits.gpu_memory_max}")
    # A straggler is slower than the limit beyond its own step-to-step noise: both its median ratio and the
    # floor its spread supports exceed straggler_ratio_max (a false alarm costs as much as a miss).
    stragglers = sorted(
        (r for r, ratio in ratios.items() if ratio > limits.straggler_ratio_max and floors[r] > limits.straggler_ratio_max),
        key=lambda r: -ratios[r],
    )
    noisy = {
        r: (ratio, floors[r]) for r, ratio in ratios.items() if ratio > limits.straggler_ratio_max and r not in stragglers
    }
    for rank in stragglers:
        role = (peers or {}).get(rank)
        others = _median([v for r, v in compute.items() if r != rank and (peers or {}).get(r) == role])
        whose = "the other ranks'" if peers is None else f"the other pipeline stage {role} ranks'"
        on = f" on {hosts[rank]}" if hosts and rank in hosts else ""
        failures.append(
            f"rank {rank}{on} computes {compute[rank]:.3f} s/step, {ratios[rank]:.2f}x {whose} median "
            f"({others:.3f} s of {basis_text}, at least {floors[rank]:.2f}x within its step-to-step noise; "
            f"straggler_ratio_max {limits.straggler_ratio_max}); they wait for it in the gradient synchronisation"
        )

    slow_rank = stragglers[0] if stragglers else None
    if no_sync:
        look.append(
            "gradient synchronisation: DDP's no_sync or FSDP's set_requires_gradient_sync left on, the DDP comm "
            "hook, and the correctness dimension"
        )
    if failures:
        look.append(
            "the communication share, then data-loader wait"
            if slow_rank is None
            else "; ".join(
                f"host {hosts[r]} (rank {r})" if hosts and r in hosts else f"rank {r}'s host" for r in stragglers
            )
            + " (its CPU/GPU, clocks, neighbours)"  # fmt: skip
        )
        if max(data_wait.values(), default=0) > 0.2 or not resources.passed:
            look.append("data-loader wait is high: more workers, prefetch, larger record files")
    figures = PerformanceFigures(
        scaling_efficiency=efficiency,
        tokens_per_s=tokens_n,
        tokens_per_s_per_rank=tokens_n / world if world else None,
        tokens_per_cpu_s=tokens_cpu,
        step_cpu_s=_median(list(cpu.values())) if by_cpu else None,
        timed_s=sum(rank0[s].step_time_s for s in steps),
        cpu_timed_s=sum(cpu.values()) if by_cpu else None,
        reference_tokens_per_s=tokens_1,
        comm_share=comm_share,
        slow_rank=slow_rank,
        slow_host=(hosts or {}).get(slow_rank) if slow_rank is not None else None,
        layout=_mesh_layout(dims, world, sharding).degrees(),
    )
    return DimensionResult(
        name="performance",
        passed=not failures,
        figures=figures,
        measured={
            "comm_share_per_rank": shares,
            "compute_s_per_rank": compute,
            "straggler_ratio_per_rank": ratios,
            "straggler_ratio_floor_per_rank": floors,
            # above the limit by the median, not beyond the run's own step-to-step noise: not judged a straggler
            "stragglers_within_noise": sorted(noisy),
            "straggler_basis": basis,
            "data_wait_share_per_rank": data_wait,
            "resources": resources.to_json(),
            **({"checkpoint_interval": interval.to_json()} if interval is not None else {}),
            **({"comm_bytes_per_dim": _per_dimension(rank0, steps, lambda r: r.comm_bytes)} if dims else {}),
            **({"comm_s_per_dim": _per_dimension(rank0, steps, lambda r: r.comm_s_per_dim)} if dims else {}),
            **({"gpu": gpu} if gpu else {}),
        },
        threshold={
            "scaling_efficiency_min": limits.scaling_efficiency_min,
            "comm_share_max": limits.comm_share_max,
            "straggler_ratio_max": limits.straggler_ratio_max,
            "compute_share_min": limits.compute_share_min,
        },
        evidence={
            "steps": [steps[0], steps[-1]] if steps else [], "sharding": sharding, "data_parallel_ranks": sync_ranks
        },
        message="; ".join(failures),
        look_first="; ".join(look),
    )


# ---- stability ------------------------------------------------------------------------------


def check_stability(
    metrics: dict[int, StepRecord],
    limits: AcceptanceThresholds,
    exit_ok: bool,
    exit_reason: str = "",
    stalled_after_step: int | None = None,
    unreachable_hosts: list[str] | None = None,
) -> DimensionResult:
    """No abnormal exit, NaN/Inf loss, loss spike or stall."""
    problems, first_bad = [], None
    if not exit_ok:
        problems.append(f"abnormal exit: {exit_reason}")
    if stalled_after_step is not None:
        silent = f"; not answering: {', '.join(unreachable_hosts)}" if unreachable_hosts else ""
        problems.append(
            f"no progress for {limits.stall_timeout_s:.0f}s after step {stalled_after_step} (a hang){silent}"
        )
        first_bad = stalled_after_step
    recent: list[float] = []
    for step in sorted(metrics):
        loss = metrics[step].loss
        if not math.isfinite(loss):
            problems.append(f"loss is {loss} at step {step}")
            first_bad = step if first_bad is None else min(first_bad, step)
            break
        window = recent[-limits.loss_spike_window_steps :]
        if len(window) >= limits.loss_spike_window_steps and loss > limits.loss_spike_factor * statistics.median(
            window
        ):
            median = statistics.median(window)
            problems.append(f"loss spike at step {step}: {loss:.3f} > {limits.loss_spike_factor} x median {median:.3f}")
            first_bad = step if first_bad is None else min(first_bad, step)
            break
        recent.append(loss)
    steps = sorted(metrics)
    return DimensionResult(
        name="stability",
        passed=not problems,
        measured={"steps": len(steps), "first_bad_step": first_bad},
        threshold={"loss_spike_factor": limits.loss_spike_factor, "stall_timeout_s": limits.stall_timeout_s},
        evidence={"steps": [steps[0], steps[-1]] if steps else []},
        message="; ".join(problems),
        look_first=""
        if not problems
        else "the learning rate against the batch size, then the data around the first bad step",
    )


# ---- recovery -------------------------------------------------------------------------------


def check_recovery(
    reference: dict[int, StepRecord],
    resumed: dict[int, StepRecord],
    checkpoint_step: int | None,
    resumed_from_step: int | None,
    resumed_samples: dict[int, dict[int, dict[str, Any]]] | None = None,
    reference_samples: dict[int, dict[int, dict[str, Any]]] | None = None,
    bit_identical: bool = True,
) -> DimensionResult:
    """Resumed from the last complete checkpoint, no data step repeated or skipped, loss continuing."""
    problems = []
    if resumed_from_step is None:
        problems.append("the relaunched job did not resume from a checkpoint")
    elif checkpoint_step is not None and resumed_from_step != checkpoint_step:
        problems.append(
            f"resumed from step {resumed_from_step}, the last complete checkpoint was step {checkpoint_step}"
        )
    after = sorted(s for s in resumed if resumed_from_step is not None and s > resumed_from_step)
    if not after:
        problems.append("no step ran after the resume")
    mismatched = [
        s
        for s in after
        if s in reference
        and (
            resumed[s].loss != reference[s].loss
            if bit_identical
            else abs(resumed[s].loss - reference[s].loss) > 1e-4 * abs(reference[s].loss)
        )
    ]
    if mismatched:
        problems.append(
            f"loss after the resume differs from the uninterrupted run from step {mismatched[0]} "
            f"({resumed[mismatched[0]].loss!r} vs {reference[mismatched[0]].loss!r})"
        )
    if resumed_samples is not None and reference_samples is not None:
        for rank, recs in resumed_samples.items():
            wrong = [
                s
                for s in after
                if s in recs and recs[s]["indices"] != reference_samples.get(rank, {}).get(s, {}).get("indices")
            ]
            if wrong:
                problems.append(f"rank {rank} was fed other samples after the resume (step {wrong[0]})")
    return DimensionResult(
        name="recovery",
        passed=not problems,
        figures=RecoveryFigures(
            resumed_from_step=resumed_from_step,
            steps_compared=len(after),
            first_mismatch=mismatched[0] if mismatched else None,
        ),
        threshold={"resume_step": checkpoint_step, "loss": "bit-identical" if bit_identical else "within 1e-4"},
        message="; ".join(problems),
        look_first="" if not problems else "what the checkpoint holds (optimizer, scheduler, RNG, sampler position)",
    )
