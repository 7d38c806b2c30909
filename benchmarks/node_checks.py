"""Wall time of the node checks for 1, 4 and 16 test nodes, the cost per node, and what forks change.

Starts real key-only sshd test nodes on 127.0.0.2, 127.0.0.3, ... (as the integration tests do; needs
root and openssh-server), runs the full check (`run_node_checks`: every role, rendezvous port, SSH
probe) against them, and reports for each (nodes, forks):

- wall time of the check, and wall time per node;
- controller CPU per node (ansible-playbook, its workers and ssh clients: what grows on the controller);
- an extrapolation to 1,000 nodes.

The test nodes run on this machine, so the nodes' own work (Python module runs) competes with the
controller for the same cores: on a small machine the figures are an upper bound of a real check,
where every node does its share on its own CPU.

Usage: python benchmarks/node_checks.py [--runs 1:16,4:16,16:16,16:4] [--network loopback|netns]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from tasks.cluster import ClusterConfig
from tasks.nodes.check import run_node_checks
from tasks.nodes.config import NodesConfig

# The test-node helpers live with the integration tests, which are not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.nodes.conftest import free_port  # noqa: E402
from tests.integration.nodes.testhosts import HostSpec, missing_prerequisites, start_cluster  # noqa: E402

# Tasks that run on every node in turn (linear strategy); with ceil(N / forks) batches each.
REMOTE_TASKS = 10


def children_cpu_s() -> float:
    """CPU seconds of finished child processes (ansible-playbook and everything it waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(n_nodes: int, forks: int, network: str, work: Path) -> dict[str, float]:
    """One check of n_nodes fresh test nodes with `forks`."""
    cluster = start_cluster(work / f"n{n_nodes}-f{forks}", [HostSpec(f"node-{i:02d}") for i in range(n_nodes)], network)
    try:
        nodes = NodesConfig(**cluster.nodes_section(rdzv_port=free_port(), forks=forks, run_timeout_s=1800))
        cpu, started = children_cpu_s(), time.perf_counter()
        report = run_node_checks(nodes, ClusterConfig(scheduler="slurm", nodes=n_nodes, procs_per_node=1))
        wall, cpu = time.perf_counter() - started, children_cpu_s() - cpu
    finally:
        cluster.close()
    if not report.ok:
        raise RuntimeError(f"the benchmark nodes should pass: {[(r.check, r.finding) for r in report.blocking]}")
    return {
        "nodes": n_nodes,
        "forks": forks,
        "wall_s": wall,
        "per_node_s": wall / n_nodes,
        "cpu_per_node_s": cpu / n_nodes,
    }


def main() -> None:
    """Run the measurements and print the table and the extrapolation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="1:16,4:16,16:16,16:4", help="nodes:forks pairs, comma-separated")
    parser.add_argument("--network", default="loopback", choices=["loopback", "netns"])
    args = parser.parse_args()
    missing = missing_prerequisites(args.network)
    if missing:
        raise SystemExit(f"needs {', '.join(missing)}")
    runs = [tuple(int(x) for x in pair.split(":")) for pair in args.runs.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as work:
        for n_nodes, forks in runs:
            results.append(measure(n_nodes, forks, args.network, Path(work)))
            r = results[-1]
            print(
                f"nodes {r['nodes']:>3}  forks {r['forks']:>3}  wall {r['wall_s']:7.1f} s  "
                f"per node {r['per_node_s']:6.2f} s  controller CPU per node {r['cpu_per_node_s']:5.2f} s",
                flush=True,
            )
    single = next((r for r in results if r["nodes"] == 1), results[0])
    widest = max(results, key=lambda r: (r["nodes"], r["forks"]))
    cores = os.cpu_count() or 1
    print(f"\nthis machine: {cores} core(s); test nodes share them with the controller")
    print(
        f"one node end to end: {single['wall_s']:.1f} s (about {single['wall_s'] / REMOTE_TASKS:.1f} s per task round)"
    )
    for forks in (50, 100, 200):
        # Latency bound: each remote task takes ceil(N / forks) rounds of about one single-node task round.
        latency = single["wall_s"] * math.ceil(1000 / forks)
        # Controller bound: the controller CPU per node measured here, spread over a 32-core controller.
        controller = widest["cpu_per_node_s"] * 1000 / 32
        print(
            f"1,000 nodes, forks {forks:>3}: about {max(latency, controller) / 60:5.1f} min "
            f"(rounds {latency / 60:.1f} min, controller CPU {widest['cpu_per_node_s'] * 1000 / 60:.0f} core-min "
            f"= {controller / 60:.1f} min on 32 cores)"
        )


if __name__ == "__main__":
    main()
