"""Wall time of the health gate for 1, 4 and 16 test nodes, against its budget (<= 60 s at the default level).

Starts real key-only sshd test nodes on 127.0.0.2, 127.0.0.3, ... (as the integration tests do; needs root and
openssh-server) and runs the gate the launch step runs before a job on the SSH launcher (`run_health_gate`: every
node's probe over SSH at once -- compute, storage, the bandwidth ring -- then the verdict), `--repeat` times per
node count. Printed per node count: the gate's wall time (median and spread), the slowest node's own probe time,
the spread of the probes' start times (SSH and the Python start-up on a shared machine), the median compute rate
in wall time and per CPU-second, the median ring bandwidth, and whether any node was excluded (none should be:
the nodes are healthy, so an exclusion is a false alarm).

The test nodes share this machine's cores, so N nodes' probes compete for them: the compute rate in wall time
falls as N grows and the figures are an upper bound of a real cluster's, where every node probes on its own CPUs.

Usage: python benchmarks/health_gate.py [--nodes 1,4,16] [--repeat 1] [--compute-s 1.0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 60.0


def main() -> int:
    """Run the gate on each node count and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,4,16", help="node counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--compute-s", type=float, default=1.0)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tasks.launch.cluster import ClusterConfig
    from tasks.launch.health_gate import run_health_gate
    from tasks.launch.ssh import SshLauncher
    from tests.integration.nodes.testhosts import HostSpec, missing_prerequisites, start_cluster
    from training.config import TrainConfig

    missing = missing_prerequisites("loopback")
    if missing:
        print(f"the test nodes need {', '.join(missing)}: run `bash .ci/setup --test` as root")
        return 2
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    header = (f"{'nodes':>5} {'gate s':>8} {'spread':>13} {'slowest probe s':>15} {'start spread s':>14} "
              f"{'GFLOP/s wall':>12} {'per CPU-s':>9} {'ring MB/s':>9} {'excluded':>8} {'budget':>6}")  # fmt: skip
    print(header)
    for count in [int(n) for n in args.nodes.split(",")]:
        with tempfile.TemporaryDirectory(prefix="gate-bench-") as tmp:
            hosts = start_cluster(Path(tmp) / "hosts", [HostSpec(f"node-{i}") for i in range(count)])
            try:
                seconds, probes, excluded = [], [], 0
                for attempt in range(args.repeat):
                    raw = {"scheduler": "ssh", "nodes": count, "procs_per_node": 1,
                           "ssh": {"hosts": hosts.nodes_section()["hosts"], "user": "root",
                                   "key_path": str(hosts.key_path), "known_hosts_path": str(hosts.known_hosts_path),
                                   "python": hosts.job_python},
                           "health_gate": {"compute_s": args.compute_s}}  # fmt: skip
                    cluster = ClusterConfig(**raw)
                    train = TrainConfig.model_validate(_train(Path(tmp) / f"out-{attempt}"))
                    outcome = run_health_gate(SshLauncher(), cluster, train)
                    assert outcome.record is not None
                    seconds.append(outcome.record.seconds)
                    probes += outcome.record.probes
                    excluded += len(outcome.record.excluded)
            finally:
                hosts.close()
        gate = statistics.median(seconds)
        slowest = max(p.probe_s for p in probes)
        start_spread = max(p.started_unix_s for p in probes) - min(p.started_unix_s for p in probes)
        wall = statistics.median(p.compute_gflops or 0 for p in probes)
        cpu = statistics.median(p.compute_cpu_gflops or 0 for p in probes)
        ring = [p.bandwidth_mb_s for p in probes if p.bandwidth_mb_s]
        print(f"{count:>5} {gate:>8.1f} {min(seconds):>6.1f}-{max(seconds):<6.1f} {slowest:>15.1f} "
              f"{start_spread:>14.1f} {wall:>12.1f} {cpu:>9.1f} {statistics.median(ring) if ring else 0:>9.0f} "
              f"{excluded:>8} {'ok' if gate <= BUDGET_S else 'OVER':>6}")  # fmt: skip
    return 0


def _train(out: Path) -> dict:
    """The tests' tiny training config, writing to `out` (the gate writes its record there; no job is started)."""
    from tests.conftest import TINY_SPEC, deep_merge

    paths = {"data": {"dataset_url": str(out / "no-dataset")}, "checkpoint": {"url": str(out / "checkpoints")},
             "run": {"output_url": str(out)}}  # fmt: skip
    return {k: v for k, v in deep_merge(TINY_SPEC, paths).items() if k not in ("name", "cluster")}


if __name__ == "__main__":
    sys.exit(main())
