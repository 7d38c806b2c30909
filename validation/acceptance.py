"""The six acceptance dimensions as plain functions over run artifacts (read through training/run_output.py).

Every check returns a `DimensionResult`: passed or not, the measured value, the
threshold, the evidence (files, steps), and when it fails, what to look at first.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from training.config import StrictModel
from training.run_output import RANKS, RunOutput


class AcceptanceThresholds(StrictModel):
    """Pass thresholds of the acceptance dimensions."""

    correctness_max_rel_deviation: float = Field(
        default=1e-4,
        gt=0,
        description="Largest relative loss deviation of the distributed run (fp32, no dropout) from the "
        "independent reference over acceptance.reference_steps. Set from benchmarks/acceptance_noise.py: "
        "clean runs deviate by about 1e-7, a rank initialised differently, missing gradient sync or a broken "
        "accumulation by 3e-3 to 1e-2.",
    )
    scaling_efficiency_min: float = Field(
        default=0.7, gt=0, le=1.5, description="Smallest T_N / (N * T_1) (throughput of N ranks vs one)."
    )
    comm_share_max: float = Field(default=0.5, gt=0, le=1, description="Largest share of step time in communication.")
    straggler_ratio_max: float = Field(
        default=1.25,
        gt=1,
        description="Largest ratio of a rank's median compute time per step to the median of the other ranks' "
        "(a rank above it is a straggler the others wait for).",
    )
    gpu_utilization_min: float = Field(default=0.7, gt=0, le=1, description="GPUs: smallest mean utilisation.")
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
        "memory that counts as agreement (acceptance.json `plan_accuracy`; shown, never failing a dimension).",
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


DIMENSIONS = ("connectivity", "correctness", "performance", "stability", "data_consistency", "recovery")
"""The six acceptance dimensions, in report order."""


@dataclass
class DimensionResult:
    """One dimension's verdict: passed, failed, or not measured (`passed` None: nothing to judge it by)."""

    name: str
    passed: bool | None
    measured: Any
    threshold: Any
    evidence: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    look_first: str = ""

    @property
    def status(self) -> str:
        """passed, failed or not measured."""
        return {True: "passed", False: "failed", None: "not measured"}[self.passed]

    @classmethod
    def not_measured(cls, name: str, why: str, look_first: str = "") -> DimensionResult:
        """A dimension that could not be measured (not a failure of its own: `why` names the finding that is)."""
        return cls(name, None, None, None, {}, f"not measured: {why}", look_first)

    def to_json(self) -> dict[str, Any]:
        """As a dict, with its status."""
        return {**asdict(self), "status": self.status}


def rank_metrics(output_dir: Path) -> dict[int, dict[int, dict[str, Any]]]:
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
            "connectivity", False, None, expected_world, {"file": str(path)}, f"{RANKS} was never written",
            "the job did not get through rendezvous: check the node checks (ports, hostnames) and the job log",
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
    measured: dict[str, Any] = {"world_size": record.world_size, "hosts": {h: len(v) for h, v in by_host.items()}}
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
        "connectivity",
        not problems,
        measured,
        threshold,
        evidence,
        "; ".join(problems),
        look if problems else "",
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


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The world mesh's dimensions (training/mesh.py), outermost first; their product is the world size."""
MESH_GROUPS = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp_replicate", "dp_shard"), "ep": ("ep",)}
"""A sub-group's name in ranks.json and the coordinates its ranks differ in (an EP group: consecutive dp ranks)."""


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
    return check


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
(2 CPU ranks, gloo, fp32, grad_accum_steps 2; the tiny and the embedded default's model, 10 steps)."""


def check_correctness(
    distributed: dict[int, dict[str, Any]], reference: dict[int, dict[str, Any]], max_rel: float
) -> DimensionResult:
    """Every step's loss within max_rel of the independent reference (same data, seed, global batch)."""
    steps = sorted(set(distributed) & set(reference))
    threshold = {"max_rel_deviation": max_rel, "clean_rel_deviation_measured": CLEAN_REL_DEVIATION}
    if not steps:
        return DimensionResult(
            "correctness", False, None, threshold, {}, "no common steps to compare", "the two runs' metrics"
        )
    deviations = {
        s: abs(distributed[s]["loss"] - reference[s]["loss"]) / max(abs(reference[s]["loss"]), 1e-12) for s in steps
    }
    worst = max(deviations, key=lambda s: deviations[s] if math.isfinite(deviations[s]) else math.inf)
    value = deviations[worst]
    passed = all(math.isfinite(d) and d <= max_rel for d in deviations.values())
    first_bad = next((s for s in steps if not (math.isfinite(deviations[s]) and deviations[s] <= max_rel)), None)
    return DimensionResult(
        "correctness",
        passed,
        {"max_rel_deviation": value, "worst_step": worst},
        threshold,
        {"steps_compared": [steps[0], steps[-1]], "first_failing_step": first_bad, "deviation_per_step": deviations},
        "" if passed else f"loss deviates from the reference by {value:.3g} (relative) at step {worst}",
        "" if passed else "data order and seeds per rank (sampler records), then gradient accumulation and sync",
    )


# ---- performance ----------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def straggler_ratios(
    distributed: dict[int, dict[int, dict[str, Any]]], steps: list[int], peers: dict[int, int] | None = None
) -> dict[int, float]:
    """Per rank, the median over `steps` of its compute time divided by the median of the OTHER ranks' in the same
    step; NaN where unknown.

    Against the others, not all ranks: with two ranks the median of all sits halfway and hides a 1.5x rank.
    Per step, then the median: load that slows every rank in a step (a busy host, a shared core) cancels out.
    `peers` (rank -> a role, for a pipeline layout its stage) compares each rank with the ranks of its own role
    only: the stages do different work (the first embeds, the last computes the loss and waits least in the
    bubble), so a stage is no straggler for being another stage; a rank alone in its role has no ratio.
    """
    role = peers or {}
    per_step: dict[int, list[float]] = {rank: [] for rank in distributed}
    for step in steps:
        compute = {rank: m[step]["compute_s"] for rank, m in distributed.items() if step in m}
        for rank, value in compute.items():
            others = _median([v for r, v in compute.items() if r != rank and role.get(r) == role.get(rank)])
            if others > 0:
                per_step[rank].append(value / others)
    return {rank: _median(values) for rank, values in per_step.items()}


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def grad_sync_problem(
    distributed: dict[int, dict[int, dict[str, Any]]], world: int, sharding: str, always_timed: bool | None = None
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
        comm = [m["comm_s"] for m in metrics.values() if m.get("comm_s") is not None]
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


def layout_text(sizes: dict[str, int], sharding: str, *extra: str) -> str:
    """A layout in words, outermost dimension first, from its degrees (pp, dp, cp, tp, ep; a missing one is 1):
    "pp2 x dp2 x tp2 (fsdp)", "dp4 (ddp)"."""
    text = " x ".join(f"{d}{sizes.get(d, 1)}" for d in ("pp", "dp", "cp", "tp") if sizes.get(d, 1) > 1 or d == "dp")
    ep = sizes.get("ep", 1)
    return text + (f" ep{ep}" if ep > 1 else "") + f" ({', '.join([sharding, *extra])})"


def _mesh_sizes(dims: dict[str, int] | None, world: int) -> dict[str, int]:
    if not dims:
        return {"dp": world}
    return {**dims, "dp": dims["dp_replicate"] * dims["dp_shard"]}


def _per_dimension(rank0: dict[int, dict[str, Any]], steps: list[int], key: str) -> dict[str, float]:
    """The median over `steps` of a per-dimension record (comm_bytes: {"tp": ..., "dp": ...}) of rank 0."""
    values: dict[str, list[float]] = defaultdict(list)
    for s in steps:
        for dim, value in (rank0[s].get(key) or {}).items():
            values[dim].append(float(value))
    return {dim: _median(v) for dim, v in sorted(values.items())}


def check_performance(
    distributed: dict[int, dict[int, dict[str, Any]]],
    reference: dict[int, dict[str, Any]],
    world: int,
    limits: AcceptanceThresholds,
    gpu: dict[str, float] | None = None,
    sharding: str = "ddp",
    mesh: MeshCheck | None = None,
    hosts: dict[int, str] | None = None,
) -> DimensionResult:
    """Scaling efficiency, communication share (and GPU utilisation/memory), gradient synchronisation that
    happened; names a rank that lags (compute time above straggler_ratio_max x the median of the others), and
    its host where `hosts` (rank -> host name, from ranks.json) tells it.

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
    tokens_n = _median([rank0[s]["tokens_per_s"] for s in steps])
    tokens_1 = _median([reference[s]["tokens_per_s"] for s in ref_steps])
    efficiency = tokens_n / (world * tokens_1) if tokens_1 > 0 else float("nan")
    shares = {
        rank: _median(
            [m[s]["comm_s"] / m[s]["step_time_s"] for s in steps if s in m and m[s].get("comm_s") is not None]
        )
        for rank, m in distributed.items()
    }
    comm_share = max((v for v in shares.values() if math.isfinite(v)), default=float("nan"))
    compute = {rank: _median([m[s]["compute_s"] for s in steps if s in m]) for rank, m in distributed.items()}
    ratios = straggler_ratios(distributed, steps, peers)
    data_wait = {
        rank: _median([m[s]["data_wait_s"] / m[s]["step_time_s"] for s in steps if s in m])
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
    if gpu:
        if gpu.get("utilization", 1.0) < limits.gpu_utilization_min:
            failures.append(f"GPU utilisation {gpu['utilization']:.2f} < {limits.gpu_utilization_min}")
        if gpu.get("memory_fraction", 0.0) > limits.gpu_memory_max:
            failures.append(f"GPU memory {gpu['memory_fraction']:.2f} > {limits.gpu_memory_max}")
    stragglers = sorted(
        (r for r, ratio in ratios.items() if ratio > limits.straggler_ratio_max), key=lambda r: -ratios[r]
    )
    for rank in stragglers:
        role = (peers or {}).get(rank)
        others = _median([v for r, v in compute.items() if r != rank and (peers or {}).get(r) == role])
        whose = "the other ranks'" if peers is None else f"the other pipeline stage {role} ranks'"
        on = f" on {hosts[rank]}" if hosts and rank in hosts else ""
        failures.append(
            f"rank {rank}{on} computes {compute[rank]:.3f} s/step, {ratios[rank]:.2f}x {whose} median "
            f"({others:.3f} s; straggler_ratio_max {limits.straggler_ratio_max}); they wait for it in the "
            "gradient synchronisation"
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
        if max(data_wait.values(), default=0) > 0.2:
            look.append("data-loader wait is high: more workers, prefetch, larger record files")
    return DimensionResult(
        "performance",
        not failures,
        {
            "scaling_efficiency": efficiency,
            "tokens_per_s": tokens_n,
            "tokens_per_s_per_rank": tokens_n / world if world else None,
            "reference_tokens_per_s": tokens_1,
            "comm_share": comm_share,
            "comm_share_per_rank": shares,
            "compute_s_per_rank": compute,
            "straggler_ratio_per_rank": ratios,
            "data_wait_share_per_rank": data_wait,
            "slow_rank": slow_rank,
            "slow_host": (hosts or {}).get(slow_rank) if slow_rank is not None else None,
            "layout": layout_text(_mesh_sizes(dims, world), sharding),
            **({"comm_bytes_per_dim": _per_dimension(rank0, steps, "comm_bytes")} if dims else {}),
            **({"comm_s_per_dim": _per_dimension(rank0, steps, "comm_s_per_dim")} if dims else {}),
            **({"gpu": gpu} if gpu else {}),
        },
        {
            "scaling_efficiency_min": limits.scaling_efficiency_min,
            "comm_share_max": limits.comm_share_max,
            "straggler_ratio_max": limits.straggler_ratio_max,
        },
        {"steps": [steps[0], steps[-1]] if steps else [], "sharding": sharding, "data_parallel_ranks": sync_ranks},
        "; ".join(failures),
        "; ".join(look),
    )


# ---- stability ------------------------------------------------------------------------------


def check_stability(
    metrics: dict[int, dict[str, Any]],
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
        loss = metrics[step]["loss"]
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
        "stability",
        not problems,
        {"steps": len(steps), "first_bad_step": first_bad},
        {"loss_spike_factor": limits.loss_spike_factor, "stall_timeout_s": limits.stall_timeout_s},
        {"steps": [steps[0], steps[-1]] if steps else []},
        "; ".join(problems),
        "" if not problems else "the learning rate against the batch size, then the data around the first bad step",
    )


# ---- recovery -------------------------------------------------------------------------------


def check_recovery(
    reference: dict[int, dict[str, Any]],
    resumed: dict[int, dict[str, Any]],
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
            resumed[s]["loss"] != reference[s]["loss"]
            if bit_identical
            else abs(resumed[s]["loss"] - reference[s]["loss"]) > 1e-4 * abs(reference[s]["loss"])
        )
    ]
    if mismatched:
        problems.append(
            f"loss after the resume differs from the uninterrupted run from step {mismatched[0]} "
            f"({resumed[mismatched[0]]['loss']!r} vs {reference[mismatched[0]]['loss']!r})"
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
        "recovery",
        not problems,
        {
            "resumed_from_step": resumed_from_step,
            "steps_compared": len(after),
            "first_mismatch": mismatched[0] if mismatched else None,
        },
        {"resume_step": checkpoint_step, "loss": "bit-identical" if bit_identical else "within 1e-4"},
        {},
        "; ".join(problems),
        "" if not problems else "what the checkpoint holds (optimizer, scheduler, RNG, sampler position)",
    )
