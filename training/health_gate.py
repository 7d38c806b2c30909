"""The health gate: per-node probes run inside the job's allocation, after placement and before rendezvous.

Each node runs `python -m training.health_gate probe` (the launcher starts it: the local one on this machine, the
SSH one over SSH on every host, Slurm as a step of the batch script, Kubernetes as an init container):

- compute: a fixed fp32 matmul on one thread, repeated over `compute_s`, timed in wall time and in the process's
  CPU time. A slow processor lowers the rate per CPU-second; a CPU quota (a cgroup's cfs quota) slows wall time,
  not CPU time per operation: it lowers the share of the probe's wall time the node was on a CPU, and the node's
  cgroup counts the periods it throttled it;
- storage: write, fsync and read back `storage_mb` in each probed folder (the run's output, the memory tier's
  folder, `storage_paths`): a full disk or a read-only mount fails it;
- bandwidth: every node sends `bandwidth_mb` over TCP to the next node of the ring (node i to i+1), as NCCL's ring
  does, while it receives from the one before; judged against `min_bandwidth_mb_s` and, where set, the peers.

The nodes start measuring together (a barrier of ready files in the shared gate folder). `judge` then compares
each node with its peers (the median of the others, which a single slow node cannot move; of two nodes the slower
is judged against the faster) and, where it has fewer than two peers, with the cluster's baseline rate: excluded is
a node whose rate per CPU-second is below the reference by more than `max_slowdown` (widened by the noise measured
between the probe's own repeats), and a node whose on-CPU share is below its peers' by as much while its cgroup
reports throttling. A busy machine must not exclude a healthy node: peers waiting for a CPU on one busy machine
differ in wall time by 2x and more (measured here), in CPU time per operation by a few per cent, and a node whose
cgroup says it was not throttled is not judged on its wall time. The verdict is written to
`health_gate.json` in the run's output folder; `read_health_gate` reads it back (its `seconds` count as start-up in
the goodput figures).
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from training.config import StrictModel
from training.storage import StorageConfig, filesystem, is_local, join, local_path, write_bytes_atomic

HEALTH_GATE_FILE = "health_gate.json"
GATE_DIR = "health_gate"
"""Per-node probe records (`<host>.json`) and the barrier's ready files, in the run's output folder."""
HEALTH_GATE_EXIT_CODE = 78
GATE_NODE_ENV = "TDEPLOY_GATE_NODE"
"""Where a Kubernetes init container finds its node's name (the downward API's spec.nodeName)."""
"""A gate step's exit status when it excluded a node and the job cannot start without it (Slurm, Kubernetes)."""
NOISE_WIDENING = 4.0
"""The band is widened to 1 + this many times the measured relative spread between a node's repeats."""
_COMPUTE_WINDOWS = 5
BANDWIDTH_PARTS = 4


class HealthGateConfig(StrictModel):
    """The spec's `cluster.health_gate`: what each node is probed for before the job's rendezvous."""

    level: Literal["off", "default"] = Field(
        default="default",
        description="default: compute, storage and bandwidth probes on every node (budget <= 60 s); off: none.",
    )
    matmul_size: int = Field(default=256, ge=16, le=8192, description="Side of the fixed fp32 square matmul.")
    compute_s: float = Field(
        default=1.0, gt=0, le=30, description="Seconds the compute probe repeats the matmul for (in 5 windows)."
    )
    max_slowdown: float = Field(
        default=2.0,
        gt=1,
        le=100,
        description="A node whose compute rate is below its reference (the peers' median, else the baseline) "
        "divided by this is excluded; widened by the measured noise of the probe's repeats.",
    )
    baseline_gflops: float | None = Field(
        default=None,
        gt=0,
        description="The cluster's compute rate per node (GFLOP/s of the probe per CPU-second, which load on the "
        "machine does not change) that a node with fewer than two peers is judged against; None = no compute "
        "verdict for a lone node.",
    )
    storage_mb: float = Field(default=8.0, gt=0, le=1024, description="MB written and read back per folder.")
    storage_paths: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Node-local folders probed besides the run's output folder and the memory tier's (absolute).",
    )
    bandwidth_mb: float = Field(default=16.0, gt=0, le=4096, description="MB sent to the next node of the ring.")
    min_bandwidth_mb_s: float | None = Field(
        default=None,
        gt=0,
        description="A node whose send rate to the next node is below this is excluded (e.g. 1000 for a 10 GbE "
        "link); None = the rate is recorded, not judged.",
    )
    max_bandwidth_slowdown: float | None = Field(
        default=None,
        gt=1,
        le=1000,
        description="A node whose send rate is below the median of the others' by this is excluded (3 nodes or "
        "more); None = not judged against its peers. Links through a busy machine's loopback or bridge are "
        "CPU-bound: healthy pairs spread 9x there (measured), so leave it off unless the links are real NICs.",
    )
    port: int = Field(default=29400, ge=1, le=65535, description="TCP port of each node's bandwidth probe.")
    timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="Budget of the whole gate; a node that has not reported by then fails."
    )

    @property
    def on(self) -> bool:
        """Whether the gate runs."""
        return self.level != "off"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class StorageProbe(_Record):
    """One folder's write and read back."""

    path: str
    ok: bool
    write_mb_s: float | None = None
    read_mb_s: float | None = None
    error: str = ""


class NodeProbe(_Record):
    """What one node measured (its `<host>.json` in the gate folder, and the last line of its probe's output)."""

    name: str
    started_unix_s: float
    probe_s: float
    compute_gflops: float | None = None
    """The matmul's rate in wall time."""
    compute_cpu_gflops: float | None = None
    """The same in the process's CPU time: unchanged by a CPU quota, lowered by a slow processor."""
    compute_noise: float | None = None
    """Relative spread (stdev / mean) of the rate between the probe's windows."""
    throttled_periods: int | None = None
    """Periods the node's cgroup CPU quota throttled it during the compute probe (None: unreadable)."""
    cpu_limit: float | None = None
    """The CPUs its cgroup's quota grants it (None: no quota, or unreadable)."""
    storage: list[StorageProbe] = Field(default_factory=list)
    peer: str | None = None
    bandwidth_mb_s: float | None = None
    """Send rate to `peer` (the next node of the ring)."""
    error: str = ""


class NodeVerdict(_Record):
    """The gate's verdict on one node."""

    name: str
    healthy: bool
    reasons: list[str] = Field(default_factory=list)
    compute_gflops: float | None = None
    """Wall-time rate of the probe."""
    compute_cpu_gflops: float | None = None
    """CPU-time rate of the probe."""
    reference_cpu_gflops: float | None = None
    """What the CPU-time rate was judged against: the median of the peers', else the baseline."""
    on_cpu_share: float | None = None
    """Share of the probe's wall time the node was on a CPU (wall rate / CPU-time rate)."""
    bandwidth_mb_s: float | None = None


class HealthGateRecord(_Record):
    """health_gate.json: every node's probe and verdict, and what the gate cost the job."""

    started_unix_s: float
    seconds: float
    """Wall time of the gate, from its start to its verdict (start-up in the goodput figures)."""
    level: str
    nodes: list[NodeVerdict]
    probes: list[NodeProbe]
    excluded: list[str] = Field(default_factory=list)
    slowdown_band: float
    """The compute band used: max_slowdown widened by the measured noise."""
    baseline_gflops: float | None = None

    @property
    def passed(self) -> bool:
        """No node was excluded."""
        return not self.excluded

    def describe(self) -> str:
        """One line for people."""
        if self.passed:
            return f"health gate passed on {len(self.nodes)} node(s) in {self.seconds:.1f}s"
        why = "; ".join(f"{v.name}: {', '.join(v.reasons)}" for v in self.nodes if not v.healthy)
        excluded = ", ".join(self.excluded)
        return f"health gate excluded {excluded} of {len(self.nodes)} node(s) in {self.seconds:.1f}s: {why}"


# ---- the probes (on the node) ------------------------------------------------------------------


def _cgroup_folder() -> Path | None:
    """This process's cgroup folder of the CPU controller (v1, or the v2 unified one), where mounted."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "cpu" in controllers.split(","):
            candidates += [Path("/sys/fs/cgroup/cpu") / relative, Path("/sys/fs/cgroup/cpu,cpuacct") / relative]
        elif controllers == "":
            candidates.append(Path("/sys/fs/cgroup") / relative)
    return next((folder for folder in candidates if (folder / "cpu.stat").is_file()), None)


def _cgroup_throttled(folder: Path | None) -> int | None:
    """nr_throttled of the cgroup `folder` (None: unreadable)."""
    try:
        for line in (folder / "cpu.stat").read_text().splitlines() if folder else []:
            key, value = line.split()
            if key == "nr_throttled":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def cgroup_cpu_limit(folder: Path | None) -> float | None:
    """The CPUs the cfs quota of `folder` and its parents grants (the tightest; None: no quota, or unreadable)."""
    limits = []
    while folder is not None and folder != folder.parent and str(folder).startswith("/sys/fs/cgroup/"):
        try:
            if (folder / "cpu.max").is_file():  # v2: "QUOTA PERIOD" or "max PERIOD"
                quota, period = (folder / "cpu.max").read_text().split()
            else:
                quota = (folder / "cpu.cfs_quota_us").read_text().strip()
                period = (folder / "cpu.cfs_period_us").read_text().strip()
            if quota not in ("max", "-1"):
                limits.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if (folder / "cgroup.procs").is_file() and (folder.parent / "cgroup.procs").is_file():
            folder = folder.parent
        else:
            break
    return min(limits) if limits else None


def compute_probe(size: int, seconds: float) -> tuple[float, float, float]:
    """The fixed matmul's rate over `seconds` in 5 windows: (wall GFLOP/s, CPU-time GFLOP/s, relative spread of the
    windows' wall rates). One thread, a fixed seed: the same work on every node."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator)
        b = torch.randn(size, size, generator=generator)
        torch.mm(a, b)  # warm-up
        flops = 2.0 * size**3
        rates, total_flops, total_wall, total_cpu = [], 0.0, 0.0, 0.0
        for _ in range(_COMPUTE_WINDOWS):
            count, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
            while True:
                torch.mm(a, b)
                count += 1
                wall = time.perf_counter() - wall0
                if wall >= seconds / _COMPUTE_WINDOWS:
                    break
            cpu = max(time.process_time() - cpu0, 1e-9)
            rates.append(count * flops / wall / 1e9)
            total_flops, total_wall, total_cpu = total_flops + count * flops, total_wall + wall, total_cpu + cpu
    finally:
        torch.set_num_threads(threads)
    noise = statistics.pstdev(rates) / statistics.fmean(rates)
    return total_flops / total_wall / 1e9, total_flops / total_cpu / 1e9, noise


def storage_probe(folder: str, megabytes: float) -> StorageProbe:
    """Write `megabytes` to a file in `folder` (fsync'd), read it back, compare, remove it."""
    path = Path(folder) / f".health-gate-{socket.gethostname()}-{os.getpid()}"
    data = os.urandom(int(megabytes * 1e6))
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        back = path.read_bytes()
        read = time.perf_counter() - start
        if back != data:
            return StorageProbe(path=folder, ok=False, error="the data read back differs from what was written")
        return StorageProbe(path=folder, ok=True, write_mb_s=megabytes / max(wrote, 1e-9),
                            read_mb_s=megabytes / max(read, 1e-9))  # fmt: skip
    except OSError as err:
        return StorageProbe(path=folder, ok=False, error=f"{type(err).__name__}: {err.strerror or err}")
    finally:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


class _Sink(threading.Thread):
    """Accepts the previous node's connection and reads what it sends, answering one byte when all arrived."""

    def __init__(self, address: str, port: int) -> None:
        super().__init__(daemon=True)
        self.server = socket.create_server((address, port), reuse_port=False)
        self.server.settimeout(1.0)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(30)
                try:
                    while len(header := conn.recv(8, socket.MSG_WAITALL)) == 8:  # one message per part
                        expected, got = int.from_bytes(header, "big"), 0
                        while got < expected:
                            chunk = conn.recv(min(1 << 20, expected - got))
                            if not chunk:
                                break
                            got += len(chunk)
                        conn.sendall(b"\x01")
                except OSError:
                    continue

    def close(self) -> None:
        self.stop.set()
        self.server.close()


def bandwidth_probe(peer: str, port: int, megabytes: float, deadline: float) -> float:
    """MB/s sent to `peer`:`port`: the best of BANDWIDTH_PARTS acknowledged parts (a link that is slow is slow in
    every part; a busy machine's scheduling delays are not); retries the connection until `deadline`."""
    payload = b"\x00" * (1 << 20)
    part = int(megabytes * 1e6 / BANDWIDTH_PARTS)
    while True:
        try:
            conn = socket.create_connection((peer, port), timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    rates = []
    with conn:
        conn.settimeout(max(5.0, deadline - time.time()))
        for _ in range(BANDWIDTH_PARTS):
            start = time.perf_counter()
            conn.sendall(part.to_bytes(8, "big"))
            sent = 0
            while sent < part:
                n = min(len(payload), part - sent)
                conn.sendall(payload[:n])
                sent += n
            if conn.recv(1) != b"\x01":
                raise ConnectionError(f"{peer}:{port} closed before acknowledging the probe's data")
            rates.append(part / 1e6 / max(time.perf_counter() - start, 1e-9))
    return max(rates)


def _barrier(folder: Path, name: str, names: list[str], deadline: float) -> None:
    """Write this node's ready file and wait until every node's is there (or the deadline: measure anyway)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ready-{name}").write_text(str(time.time()))
    while time.time() < deadline and not all((folder / f"ready-{n}").exists() for n in names):
        time.sleep(0.05)


def probe_node(
    name: str,
    config: HealthGateConfig,
    storage_paths: list[str],
    *,
    gate_dir: str | None = None,
    names: list[str] | None = None,
    address: str | None = None,
    peer: tuple[str, str] | None = None,
) -> NodeProbe:
    """Run this node's probes: storage, then (after every node in `names` is ready, via `gate_dir`) compute and the
    send to `peer` (name, address) while the sink on `address` receives from the node before."""
    started, t0 = time.time(), time.perf_counter()
    deadline = started + config.timeout_s * 0.8
    sink = _Sink(address, config.port) if address is not None and peer is not None else None
    if sink is not None:
        sink.start()
    errors: list[str] = []
    importlib.import_module("torch")  # before the barrier, so that every node starts measuring at once

    try:
        storage = [storage_probe(folder, config.storage_mb) for folder in storage_paths]
        if gate_dir is not None and names:
            _barrier(Path(gate_dir), name, names, deadline)
        cgroup = _cgroup_folder()
        throttled0 = _cgroup_throttled(cgroup)
        rate, cpu_rate, noise = compute_probe(config.matmul_size, config.compute_s)
        throttled1 = _cgroup_throttled(cgroup)
        bandwidth = None
        if gate_dir is not None and names and peer is not None:  # the links are measured once no node computes
            _barrier(Path(gate_dir), f"computed-{name}", [f"computed-{n}" for n in names], deadline)
        if peer is not None:
            try:
                bandwidth = bandwidth_probe(peer[1], config.port, config.bandwidth_mb, deadline)
            except OSError as err:
                errors.append(f"bandwidth to {peer[0]} ({peer[1]}:{config.port}): {type(err).__name__}: {err}")
        if sink is not None:  # keep receiving until the node before this one has sent (or the deadline)
            done = Path(gate_dir or ".") / f"sent-{name}"
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text("")
            while names and time.time() < deadline and not all((done.parent / f"sent-{n}").exists() for n in names):
                time.sleep(0.05)
    finally:
        if sink is not None:
            sink.close()
    throttled = None if throttled0 is None or throttled1 is None else throttled1 - throttled0
    return NodeProbe(
        name=name, started_unix_s=started, probe_s=time.perf_counter() - t0, compute_gflops=rate,
        compute_cpu_gflops=cpu_rate, compute_noise=noise, throttled_periods=throttled,
        cpu_limit=cgroup_cpu_limit(cgroup), storage=storage,
        peer=peer[0] if peer else None, bandwidth_mb_s=bandwidth, error="; ".join(errors),
    )  # fmt: skip


# ---- the verdict -------------------------------------------------------------------------------


def _median_of_others(values: dict[str, float], name: str) -> float | None:
    others = [v for n, v in values.items() if n != name]
    if len(others) >= 2:
        return statistics.median(others)
    if len(others) == 1:  # two nodes: the slower is judged against the faster
        return others[0] if others[0] > values[name] else None
    return None


def judge(
    probes: list[NodeProbe],
    config: HealthGateConfig,
    expected: list[str],
    *,
    started_unix_s: float,
    baseline_gflops: float | None = None,
    missing_reasons: dict[str, str] | None = None,
) -> HealthGateRecord:
    """Each node of `expected` healthy or excluded, with the reasons: no report, a failed storage probe, compute
    below its reference over the band, a send rate below the peers' median over max_bandwidth_slowdown."""
    by_name = {p.name: p for p in probes}
    baseline = config.baseline_gflops or baseline_gflops
    noises = [p.compute_noise for p in probes if p.compute_noise is not None]
    band = max(config.max_slowdown, 1.0 + NOISE_WIDENING * (statistics.median(noises) if noises else 0.0))
    rates = {p.name: p.compute_gflops for p in probes if p.compute_gflops}
    cpu_rates = {p.name: p.compute_cpu_gflops for p in probes if p.compute_cpu_gflops}
    on_cpu = {name: min(1.0, rates[name] / cpu_rates[name]) for name in rates if name in cpu_rates}
    sends = {p.name: p.bandwidth_mb_s for p in probes if p.bandwidth_mb_s}
    verdicts = []
    for name in expected:
        probe = by_name.get(name)
        if probe is None:
            reason = (missing_reasons or {}).get(name) or f"did not report within {config.timeout_s:g}s"
            verdicts.append(NodeVerdict(name=name, healthy=False, reasons=[reason]))
            continue
        reasons = [f"storage {s.path}: {s.error}" for s in probe.storage if not s.ok]
        rate, cpu_rate = rates.get(name), cpu_rates.get(name)
        reference = _median_of_others(cpu_rates, name) if cpu_rate is not None else None
        if reference is None and baseline is not None and len(cpu_rates) < 3:
            reference = baseline
        if cpu_rate is not None and reference is not None and cpu_rate * band < reference:
            reasons.append(f"compute {cpu_rate:.2f} GFLOP/s per CPU-second is {reference / cpu_rate:.1f}x below the "
                           f"reference {reference:.2f} (a slow processor)")  # fmt: skip
        share = on_cpu.get(name)
        peers_share = _median_of_others(on_cpu, name) if share is not None else None
        # Peers on one busy machine wait for a CPU alike; a quota's throttling is the node's own (its cgroup says
        # so where readable: a node that was not throttled is not judged on its wall time).
        throttled = probe.throttled_periods
        if throttled and probe.cpu_limit is not None and probe.cpu_limit * band < 1.0:
            # Persistent, unlike a busy moment: on an idle machine its peers get a whole CPU, it gets the quota.
            reasons.append(f"its cgroup's CPU quota grants it {probe.cpu_limit:.2f} CPU, {1 / probe.cpu_limit:.1f}x "
                           f"less than a CPU, and throttled it {throttled} times in the compute probe "
                           f"({rate:.2f} GFLOP/s in wall time, {cpu_rate:.2f} per CPU-second)")  # fmt: skip
        elif share is not None and peers_share is not None and share * band < peers_share and throttled != 0:
            why = f"its cgroup's CPU quota throttled it {throttled} times" if throttled else "throttling unreadable"
            reasons.append(f"compute {rate:.2f} GFLOP/s in wall time: on a CPU {share:.0%} of the probe against "
                           f"{peers_share:.0%} for its peers, slower than the reference by {peers_share / share:.1f}x "
                           f"in wall time but not in CPU time ({why})")  # fmt: skip
        send = sends.get(name)
        others = [v for n, v in sends.items() if n != name]
        peer_sends = statistics.median(others) if send is not None and len(others) >= 2 else None
        slowdown = config.max_bandwidth_slowdown
        if send is not None and peer_sends is not None and slowdown is not None and send * slowdown < peer_sends:
            reasons.append(f"sends {send:.0f} MB/s to {probe.peer}, {peer_sends / send:.1f}x below the peers' median")
        floor = config.min_bandwidth_mb_s
        if send is not None and floor is not None and send < floor:
            reasons.append(f"sends {send:.0f} MB/s to {probe.peer}, below min_bandwidth_mb_s={floor:g}")
        if probe.error and probe.bandwidth_mb_s is None and probe.peer is not None:
            reasons.append(probe.error)
        verdicts.append(NodeVerdict(name=name, healthy=not reasons, reasons=reasons, compute_gflops=rate,
                                    compute_cpu_gflops=cpu_rate, reference_cpu_gflops=reference,
                                    on_cpu_share=share, bandwidth_mb_s=send))  # fmt: skip
    return HealthGateRecord(
        started_unix_s=started_unix_s, seconds=time.time() - started_unix_s, level=config.level, nodes=verdicts,
        probes=probes, excluded=[v.name for v in verdicts if not v.healthy], slowdown_band=band,
        baseline_gflops=baseline,
    )  # fmt: skip


# ---- the record (one owner per file format) ----------------------------------------------------


def write_health_gate(output_url: str, record: HealthGateRecord, storage: StorageConfig | None = None) -> None:
    """Write health_gate.json into the run's output folder."""
    fs, root = filesystem(output_url, storage)
    write_bytes_atomic(fs, join(root, HEALTH_GATE_FILE), record.model_dump_json(indent=2).encode())


def read_health_gate(output_dir: str | Path, storage: StorageConfig | None = None) -> HealthGateRecord | None:
    """The run's health_gate.json (None: the gate did not run for it)."""
    fs, root = filesystem(str(output_dir), storage)
    path = join(root, HEALTH_GATE_FILE)
    if not fs.exists(path):
        return None
    return HealthGateRecord.model_validate_json(fs.cat_file(path))


def read_probes(gate_dir: str | Path) -> list[NodeProbe]:
    """The per-node probe records in a gate folder (the Slurm and Kubernetes gates' judge reads them)."""
    return [NodeProbe.model_validate_json(p.read_text()) for p in sorted(Path(gate_dir).glob("probe-*.json"))]


def storage_folders(output_url: str, memory_dir: str | None, extra: list[str]) -> list[str]:
    """The folders a node's storage probe writes to: the run's output (when local), the memory tier's, `extra`."""
    folders = [local_path(output_url)] if is_local(output_url) else []
    return list(dict.fromkeys([*folders, *([memory_dir] if memory_dir else []), *extra]))


# ---- command line (what each node runs) --------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`probe`: run this node's probes, write probe-<name>.json to --gate-dir and print it as the last line.
    `judge`: judge the probes in --gate-dir, write health_gate.json to --output, print the excluded hosts; exit
    HEALTH_GATE_EXIT_CODE when --self is excluded."""
    parser = argparse.ArgumentParser(prog="python -m training.health_gate")
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe")
    probe.add_argument("--name", default=None, help="this node's host name (default: socket.gethostname())")
    probe.add_argument("--config", required=True, help="HealthGateConfig as JSON")
    probe.add_argument("--storage", action="append", default=[], help="a folder to probe (repeatable)")
    probe.add_argument("--gate-dir", default=None, help="shared folder for the barrier and the probe records")
    probe.add_argument("--names", default="", help="every node's name, comma-separated (the barrier's members)")
    probe.add_argument("--address", default=None, help="address this node's bandwidth sink listens on")
    probe.add_argument(
        "--peer",
        default=None,
        help="NAME=ADDRESS of the next node of the ring; auto: the name "
        "after --name in --names (its address is its name)",
    )
    probe.add_argument(
        "--alone",
        action="store_true",
        help="judge this node by itself (storage, the baseline) and "
        f"exit {HEALTH_GATE_EXIT_CODE} when it is excluded (an init container without peers)",
    )
    judged = sub.add_parser("judge")
    judged.add_argument("--config", required=True)
    judged.add_argument("--gate-dir", required=True)
    judged.add_argument("--output", required=True, help="the run's output folder (health_gate.json goes there)")
    judged.add_argument("--names", required=True)
    judged.add_argument("--started", type=float, required=True)
    judged.add_argument("--self", dest="self_name", default=None)
    args = parser.parse_args(argv)
    config = HealthGateConfig.model_validate_json(args.config)
    names = [n for n in args.names.split(",") if n]
    if args.command == "probe":
        name = args.name or socket.gethostname()
        peer: tuple[str, str] | None = None
        address = args.address
        if args.peer == "auto":  # a lone node, or one missing from --names, has no ring to join
            if name in names and len(names) > 1:
                after = names[(names.index(name) + 1) % len(names)]
                peer, address = (after, after), args.address or "0.0.0.0"
        elif args.peer:
            after, _, to = args.peer.partition("=")
            peer = (after, to or after)
        result = probe_node(name, config, args.storage, gate_dir=args.gate_dir, names=names, address=address,
                            peer=peer)  # fmt: skip
        if args.gate_dir:
            write_bytes_atomic(filesystem(args.gate_dir)[0], str(Path(args.gate_dir) / f"probe-{name}.json"),
                               result.model_dump_json().encode())  # fmt: skip
        print(result.model_dump_json(), flush=True)
        if args.alone:
            record = judge([result], config, [name], started_unix_s=result.started_unix_s)
            print(record.describe(), file=sys.stderr, flush=True)
            return HEALTH_GATE_EXIT_CODE if record.excluded else 0
        return 0
    deadline = args.started + config.timeout_s
    while time.time() < deadline and len(read_probes(args.gate_dir)) < len(names):
        time.sleep(0.2)
    record = judge(read_probes(args.gate_dir), config, names, started_unix_s=args.started)
    write_health_gate(args.output, record)
    print(",".join(record.excluded), flush=True)
    print(record.describe(), file=sys.stderr, flush=True)
    if args.self_name is not None and args.self_name in record.excluded:
        return HEALTH_GATE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
