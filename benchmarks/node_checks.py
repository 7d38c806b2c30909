"""Wall time of the node checks for 1, 4 and 16 test nodes, the cost per node, and what forks change.

Starts real key-only sshd test nodes on 127.0.0.2, 127.0.0.3, ... (as the integration tests do; needs
root and openssh-server), runs the full check (`run_node_checks`: every role, rendezvous port, SSH
probe) against them, and reports for each (nodes, forks):

- wall time of the check, and wall time per node;
- controller CPU per node (ansible-playbook, its workers and ssh clients, and ansible-runner reading the
  events in this process: what grows on the controller);
- node CPU per node (each test node's sshd and everything it ran: the module runs);
- module runs per node, the most any node had (tasks that ran an Ansible module for it, on the node or
  delegated to the controller, as the runner's events report them);
- an extrapolation to 1,000 nodes;
- the goals of issue 21 beside the figures: one node <= 8 s, and the wall time per node flat (within 20%)
  from 4 to 16 nodes.

The test nodes run on this machine, so the nodes' own work (Python module runs) competes with the
controller for the same cores: on a small machine the figures are an upper bound of a real check,
where every node does its share on its own CPU.

With `--baseline REV` the same measurements also run on the code of a git revision (extracted with
`git archive` into a temporary folder; the working tree and the repository are left alone), alternating
with the working tree's, and the ratios are printed: on a shared machine, only figures measured side by
side compare.

Usage: python benchmarks/node_checks.py [--runs 1:16,4:16,16:16,16:4] [--network loopback|netns]
                                        [--baseline HEAD] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ONE_NODE_GOAL_S = 8.0
FLAT_GOAL = 0.20
FLAT_RANGE = (4, 16)

# One measurement, run in a fresh interpreter on a source tree (this one, or a baseline revision's): it uses
# only what every revision of the node checks has (run_node_checks, the test-node helpers, the runner's event
# collector), and prints one JSON line.
WORKER = r"""
import json, os, resource, sys, time
from pathlib import Path

import tasks.nodes.runner as runner
from tasks.launch.cluster import ClusterConfig
from tasks.nodes.check import run_node_checks
from tasks.nodes.config import NodesConfig
from tests.integration.nodes.conftest import free_port
from tests.integration.nodes.testhosts import HostSpec, start_cluster

# Actions that run no module: controller-side action plugins, and raw (a command without Python).
NO_MODULE = {"set_fact", "set_stats", "validate_argument_spec", "debug", "assert", "raw", "tdeploy_ssh_login_methods"}
n_nodes, forks, network, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
module_runs = {}
collect = runner._Collector.__call__


def counting(self, event):
    data = event.get("event_data") or {}
    action = str(data.get("task_action", "")).rsplit(".", 1)[-1]
    if event.get("event") in ("runner_on_ok", "runner_on_failed") and action not in NO_MODULE:
        module_runs[data["host"]] = module_runs.get(data["host"], 0) + 1
    return collect(self, event)


runner._Collector.__call__ = counting


def sshd_cpu(cluster):
    # CPU of what each sshd has reaped: the connections and every command the check ran on the node.
    total = 0.0
    for host in cluster.hosts:
        fields = Path(f"/proc/{host.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    return total


def connections_closed(cluster, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [h.process.pid for h in cluster.hosts]
        if not any(Path(f"/proc/{pid}/task/{pid}/children").read_text().split() for pid in pids):
            return
        time.sleep(0.05)


def cpu(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


cluster = start_cluster(work, [HostSpec(f"node-{i:02d}") for i in range(n_nodes)], network)
try:
    nodes = NodesConfig(**cluster.nodes_section(rdzv_port=free_port(), forks=forks, run_timeout_s=1800))
    cfg = ClusterConfig(scheduler="slurm", nodes=n_nodes, procs_per_node=1)
    node_cpu, children, own = sshd_cpu(cluster), cpu(resource.RUSAGE_CHILDREN), cpu(resource.RUSAGE_SELF)
    started = time.perf_counter()
    report = run_node_checks(nodes, cfg)
    wall = time.perf_counter() - started
    controller = cpu(resource.RUSAGE_CHILDREN) - children + cpu(resource.RUSAGE_SELF) - own
    connections_closed(cluster)
    node_cpu = sshd_cpu(cluster) - node_cpu
finally:
    cluster.close()
if not report.ok:
    raise SystemExit(f"the benchmark nodes should pass: {[(r.check, r.finding) for r in report.blocking]}")
print(json.dumps({
    "wall_s": wall,
    "controller_cpu_s": controller,
    "node_cpu_s": node_cpu,
    "module_runs": max(module_runs.values()),
}))
"""


def extract(revision: str, into: Path) -> Path:
    """The files of `revision` in a new folder (git archive: neither the working tree nor the index change)."""
    tree = into / f"rev-{revision.replace('/', '_')}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as handle:
        handle.write(archive)
        handle.seek(0)
        with tarfile.open(fileobj=handle) as tar:
            tar.extractall(tree, filter="data")
    # The test nodes run the job with <tree>/.venv/bin/python: the same environment as this tree's.
    (tree / ".venv").symlink_to(REPO / ".venv")
    return tree


def measure(tree: Path, n_nodes: int, forks: int, network: str, work: Path) -> dict[str, float]:
    """One check of n_nodes fresh test nodes with `forks`, on the code in `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(n_nodes), str(forks), network, str(work)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measurement on {tree} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(samples: list[dict[str, float]], n_nodes: int, forks: int) -> dict[str, float]:
    """Medians of repeated measurements, and the per-node figures."""
    wall = statistics.median(s["wall_s"] for s in samples)
    return {
        "nodes": n_nodes,
        "forks": forks,
        "wall_s": wall,
        "per_node_s": wall / n_nodes,
        "controller_cpu_per_node_s": statistics.median(s["controller_cpu_s"] for s in samples) / n_nodes,
        "node_cpu_per_node_s": statistics.median(s["node_cpu_s"] for s in samples) / n_nodes,
        "module_runs": max(s["module_runs"] for s in samples),
    }


def row(label: str, r: dict[str, float]) -> str:
    """One line of the table."""
    return (
        f"{label:<9} nodes {r['nodes']:>3}  forks {r['forks']:>3}  wall {r['wall_s']:6.1f} s  "
        f"per node {r['per_node_s']:5.2f} s  controller CPU/node {r['controller_cpu_per_node_s']:5.2f} s  "
        f"node CPU/node {r['node_cpu_per_node_s']:5.2f} s  module runs/node {r['module_runs']:>2}"
    )


def goals(label: str, results: list[dict[str, float]]) -> list[str]:
    """The figures of issue 21's goals, each with its goal beside it."""
    lines = []
    single = next((r for r in results if r["nodes"] == 1), None)
    if single:
        met = "met" if single["wall_s"] <= ONE_NODE_GOAL_S else "NOT met"
        lines.append(f"{label}: one node {single['wall_s']:.1f} s (goal <= {ONE_NODE_GOAL_S:.0f} s: {met})")
    low, high = FLAT_RANGE
    # At each size, the run with the most forks (all nodes at once where forks >= nodes).
    by_nodes = {r["nodes"]: r for r in sorted(results, key=lambda r: r["forks"])}
    if low in by_nodes and high in by_nodes:
        a, b = by_nodes[low]["per_node_s"], by_nodes[high]["per_node_s"]
        change = b / a - 1
        met = "met" if abs(change) <= FLAT_GOAL else "NOT met"
        lines.append(
            f"{label}: per node {a:.2f} s at {low} nodes, {b:.2f} s at {high} ({change:+.0%}; "
            f"goal within {FLAT_GOAL:.0%}: {met}); each node past {low} adds "
            f"{(by_nodes[high]['wall_s'] - by_nodes[low]['wall_s']) / (high - low):.2f} s"
        )
    return lines


def main() -> None:
    """Run the measurements (alternating with the baseline's) and print the table, the goals and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="1:16,4:16,16:16,16:4", help="nodes:forks pairs, comma-separated")
    parser.add_argument("--network", default="loopback", choices=["loopback", "netns"])
    parser.add_argument("--baseline", default=None, help="git revision to measure side by side, e.g. HEAD")
    parser.add_argument("--repeat", type=int, default=1, help="measurements per run (the median is shown)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.integration.nodes.testhosts import missing_prerequisites

    missing = missing_prerequisites(args.network)
    if missing:
        raise SystemExit(f"needs {', '.join(missing)}")
    runs = [tuple(int(x) for x in pair.split(":")) for pair in args.runs.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp:
        work = Path(tmp)
        trees = {"this tree": REPO}
        if args.baseline:
            trees[args.baseline] = extract(args.baseline, work)
        results: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
        for n_nodes, forks in runs:
            samples: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
            for attempt in range(args.repeat):
                for label, tree in trees.items():
                    folder = work / f"{label.replace(' ', '_').replace('/', '_')}-n{n_nodes}-f{forks}-{attempt}"
                    samples[label].append(measure(tree, n_nodes, forks, args.network, folder))
            for label in trees:
                results[label].append(summarise(samples[label], n_nodes, forks))
                print(row(label, results[label][-1]), flush=True)
            if args.baseline:
                mine, base = results["this tree"][-1], results[args.baseline][-1]
                print(f"{'':<9} this tree / {args.baseline}: wall x{mine['wall_s'] / base['wall_s']:.2f}", flush=True)
    cores = os.cpu_count() or 1
    print(f"\nthis machine: {cores} core(s); test nodes share them with the controller")
    for label, measured in results.items():
        for line in goals(label, measured):
            print(line)
    measured = results["this tree"]
    single = next((r for r in measured if r["nodes"] == 1), measured[0])
    widest = max(measured, key=lambda r: (r["nodes"], r["forks"]))
    for forks in (50, 100, 200):
        # Latency bound: each batch of `forks` nodes takes about as long as one node alone.
        latency = single["wall_s"] * math.ceil(1000 / forks)
        # Controller bound: the controller CPU per node measured here, spread over a 32-core controller.
        controller = widest["controller_cpu_per_node_s"] * 1000 / 32
        print(
            f"1,000 nodes, forks {forks:>3}: about {max(latency, controller) / 60:5.1f} min "
            f"(batches {latency / 60:.1f} min, controller CPU "
            f"{widest['controller_cpu_per_node_s'] * 1000 / 60:.0f} core-min = {controller / 60:.1f} min on 32 cores)"
        )


if __name__ == "__main__":
    main()
