"""Multi-host DDP over a real network-namespace test cluster against the same world on one host, and the measured
communication share against the capacity planner's for the same layout and link bandwidth.

Test hosts (tests/integration/nodes/testhosts.py, one sshd per network namespace on a bridge) run the trainer
through the SSH launcher (one torchrun agent per host, procs_per_node=1) for 1, 2 and 3 hosts, every host's eth0
capped at --rate-mbit by tc's tbf (this kernel has no netem: a rate, no delay). The same world sizes run on this
machine through the local launcher (agents on 127.0.0.1, no cap). Per run it prints the start-up probe's bus
bandwidth (run.comm_probe_mb, ranks.json), the median step time and communication share (comm_s / step_time_s,
rank 0, the first steps skipped), and for the capped multi-host runs the planner's prediction: its DP all-reduce
seconds at inter_node_gb_s = rate/8000 (an accelerator override of "cpu"), the share that gives beside its own
compute time, and beside the measured compute time; ratios measured/predicted. Runs alternate local and SSH
per world size and --repeat repeats the whole round. CPU figures, for the record only.

Needs root (namespaces, tc), sshd, iproute2. Usage:
python benchmarks/multinode.py [--hosts 3] [--rate-mbit 200] [--steps 12] [--repeat 1] [--work DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.capacity.step import CapacityInputs
from tasks.launch.base import JobState
from tasks.launch.local import run_local
from tasks.launch.ssh import SshLauncher
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import DeploymentSpec, parse_spec
from training.run_output import RunOutput
from training.storage import StorageConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test hosts live in tests/, not in the package
from tests.integration.nodes.testhosts import (  # noqa: E402
    HostSpec,
    SshdCluster,
    missing_prerequisites,
    start_cluster,
)

# About 0.85M parameters: a 3.4 MB fp32 gradient all-reduce per step, 0.14-0.18 s at 200 Mbit/s.
MODEL = {"n_layers": 4, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 344, "vocab_size": 257,
         "seq_len": 32}  # fmt: skip
SKIP_STEPS = 2  # the first steps (allocator warm-up, DDP's bucket rebuild) are left out of the medians


@dataclass
class Measured:
    """One run's figures (rank 0)."""

    label: str
    world: int
    busbw_gbps: float | None
    step_s: float
    comm_s: float | None
    compute_s: float

    @property
    def share(self) -> float | None:
        return None if self.comm_s is None else self.comm_s / self.step_s


@dataclass
class Predicted:
    """The planner's figures for the same layout at the capped link."""

    comm_s: float
    compute_s: float

    @property
    def share(self) -> float:
        return self.comm_s / (self.comm_s + self.compute_s)


def spec_for(work: Path, dataset: str, name: str, world: int, steps: int, probe_mb: float, rate_mbit: float,
             nodes: dict[str, Any] | None) -> DeploymentSpec:  # fmt: skip
    """A DDP spec of `world` one-process nodes: local agents, or SSH hosts when `nodes` is given."""
    cluster: dict[str, Any] = {"scheduler": "ssh" if nodes else "local", "nodes": world, "procs_per_node": 1,
                               "accelerator": "cpu"}  # fmt: skip
    raw: dict[str, Any] = {
        "name": f"multinode-{name}",
        "cluster": cluster,
        "model": MODEL,
        "parallel": {"sharding": "ddp", "micro_batch": 4, "grad_accum_steps": 1},
        "precision": {"dtype": "fp32"},
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 2, "schedule": "cosine"},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(work / name / "checkpoints"), "save_every_steps": 10_000, "keep_last": 1},
        "run": {"steps": steps, "seed": 7, "output_url": str(work / name / "output"), "log_every_steps": 5,
                "threads_per_rank": 1, "comm_probe_mb": [probe_mb] if world > 1 else None},
        # the planner sees the capped link as the node's network; no overlap, as comm_s counts overlapped time too
        "capacity": {"accelerators": {"cpu": {"inter_node_gb_s": rate_mbit / 8000}}, "comm_overlap": False},
    }  # fmt: skip
    if nodes:
        raw["nodes"] = nodes
    return parse_spec(raw, f"multinode:{name}")


def measure(label: str, spec: DeploymentSpec) -> Measured:
    """Run the spec to the end (local or SSH launcher) and read rank 0's figures."""
    train = spec.training_config()
    if spec.cluster.scheduler == "ssh":
        launcher = SshLauncher()
        handle = launcher.submit(spec.cluster, train, label)
        status = launcher.wait(handle, timeout_s=300)
        if status.state is not JobState.SUCCEEDED:
            raise RuntimeError(f"{label}: {status.state}: {launcher._log_text(handle)[-3000:]}")
        out = handle.output_dir
    else:
        out = run_local(spec.cluster, train, name=label).handle.output_dir
    run = RunOutput(out)
    metrics = run.metrics(0)
    steps = [m for s, m in sorted(metrics.items()) if s > SKIP_STEPS]
    ranks = run.ranks()
    probe = ranks.ranks[0].get("comm_probe") if ranks is not None else None
    comm = [m.comm_s for m in steps if m.comm_s is not None]
    return Measured(
        label=label,
        world=spec.cluster.world_size,
        busbw_gbps=probe["busbw_gbps"] if probe else None,
        step_s=statistics.median(m.step_time_s for m in steps),
        comm_s=statistics.median(comm) if comm else None,
        compute_s=statistics.median(m.step_time_s - (m.comm_s or 0.0) for m in steps),
    )


def predict(spec: DeploymentSpec) -> Predicted:
    """The planner's DP communication seconds and compute seconds per step for the spec's layout."""
    requested = CapacityInputs.of(spec).estimate().requested
    return Predicted(comm_s=requested.comm.total_seconds, compute_s=requested.compute_seconds)


def _f(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{fmt}}"


def main() -> None:
    """Start the cluster, run every world size both ways, print the table; the cluster is closed at the end."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--hosts", type=int, default=3, help="most hosts (runs 1..N hosts and world sizes)")
    parser.add_argument("--rate-mbit", type=float, default=200.0, help="tbf rate on every host's eth0, Mbit/s")
    parser.add_argument("--steps", type=int, default=12, help=f"training steps per run (first {SKIP_STEPS} skipped)")
    parser.add_argument("--probe-mb", type=float, default=2.0, help="comm probe all-reduce size, MiB")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all runs (order alternates per round)")
    parser.add_argument("--work", default=None, help="work folder (default: a new temporary one)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    missing = missing_prerequisites("netns")
    if missing:
        sys.exit(f"multinode benchmark needs: {', '.join(missing)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tdeploy-multinode-"))
    os.environ.setdefault("TDEPLOY_CACHE_DIR", str(work / "cache"))
    cluster: SshdCluster | None = None
    rows: list[tuple[Measured, Measured, Predicted | None]] = []
    try:
        cluster = start_cluster(work / "cluster", [HostSpec(f"host-{i + 1}") for i in range(args.hosts)], "netns")
        for host in cluster.hosts:
            host.delay_link(rate_mbit=args.rate_mbit)
        shared = cluster.shared
        data = PrepareConfig(
            output_url=str(shared / "data"), builtin_corpus="python-docs", builtin_max_bytes=300_000,
            tokenizer={"kind": "bytes"}, workers=1,
        )  # fmt: skip
        dataset = prepare_dataset(data, StorageConfig(), validate=False).dataset_url
        full = cluster.nodes_section()
        for round_ in range(args.repeat):
            for world in range(1, args.hosts + 1):
                nodes = dict(full, hosts=full["hosts"][:world])
                ssh = spec_for(shared, dataset, f"r{round_}-ssh{world}", world, args.steps, args.probe_mb,
                               args.rate_mbit, nodes)  # fmt: skip
                local = spec_for(shared, dataset, f"r{round_}-local{world}", world, args.steps, args.probe_mb,
                                 args.rate_mbit, None)  # fmt: skip
                order = [("local", local), ("ssh", ssh)]
                if (round_ + world) % 2:
                    order.reverse()
                got = {kind: measure(f"r{round_}-{kind}{world}", spec) for kind, spec in order}
                rows.append((got["ssh"], got["local"], predict(ssh) if world > 1 else None))
                print(f"done: round {round_} world {world}", file=sys.stderr, flush=True)
    finally:
        if cluster is not None:
            cluster.close()
    print(f"DDP, {MODEL['n_layers']}x{MODEL['d_model']} model, 1 process per host, hosts capped at "
          f"{args.rate_mbit:g} Mbit/s ({args.rate_mbit / 8000:.4f} GB/s); local = same world here")  # fmt: skip
    print(f"{'run':>10} {'world':>5} | {'busbw GB/s':>10} {'step s':>7} {'comm s':>7} {'share':>6} | "
          f"{'local busbw':>11} {'step s':>7} {'share':>6} | {'ssh/local step':>14} | "
          f"{'plan comm s':>11} {'plan cmp s':>10} {'plan share':>10} {'share*':>6} | "
          f"{'comm m/p':>8} {'share m/p':>9}")  # fmt: skip
    for ssh, local, pred in rows:
        line = (
            f"{ssh.label.split('-')[0]:>10} {ssh.world:>5} | {_f(ssh.busbw_gbps, '.4f', 10)} {ssh.step_s:7.3f} "
            f"{_f(ssh.comm_s, '.3f', 7)} {_f(ssh.share, '.2f', 6)} | {_f(local.busbw_gbps, '.4f', 11)} "
            f"{local.step_s:7.3f} {_f(local.share, '.2f', 6)} | {ssh.step_s / local.step_s:14.2f} | "
        )
        if pred is None or ssh.comm_s is None or ssh.share is None:
            line += f"{'-':>11} {'-':>10} {'-':>10} {'-':>6} | {'-':>8} {'-':>9}"
        else:
            with_measured = pred.comm_s / (pred.comm_s + ssh.compute_s)
            line += (
                f"{pred.comm_s:11.3f} {pred.compute_s:10.4f} {pred.share:10.2f} {with_measured:6.2f} | "
                f"{ssh.comm_s / pred.comm_s:8.2f} "
                f"{ssh.share / pred.share:9.2f}"
            )
        print(line)
    print("share* = planner's comm seconds beside the measured compute time (step_time_s - comm_s);")
    print(f"plan cmp s = the planner's compute seconds (catalogue cpu peak x mfu); the cap as busbw: "
          f"{args.rate_mbit / 8000:.4f} GB/s")  # fmt: skip
    print(f"work folder {work}")


if __name__ == "__main__":
    main()
