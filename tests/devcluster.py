"""A test cluster to try things on by hand: sshd hosts in network namespaces, a shared folder, an S3 endpoint.

    sudo .venv/bin/python -m tests.devcluster up --hosts 3 --dir /tmp/tdeploy-dev
    sudo .venv/bin/python -m tests.devcluster down --dir /tmp/tdeploy-dev

`up` starts the hosts (tests/integration/nodes/testhosts: node-1, node-2, ... each in its own network,
UTS and mount namespaces on a bridge, with its own host name and /etc/hosts), an S3-compatible endpoint
(moto) on the bridge address, and returns; the daemons run on in their own sessions. It writes
DIR/cluster.json (what was started: hosts, addresses, PIDs, namespace names, key and known_hosts paths,
shared folder, S3 URL) and DIR/nodes.yaml (a spec's `nodes:` section for these hosts), and prints how to
use them. `down` stops exactly what cluster.json records (by PID, checked against the start time it
recorded) and removes the namespaces, veths and bridge it names. Needs root (see testhosts).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.integration.nodes.testhosts import (
    HostSpec,
    SshdCluster,
    missing_prerequisites,
    remove_network,
    start_cluster,
)
from training.network import listen_port

CLUSTER_FILE = "cluster.json"
NODES_FILE = "nodes.yaml"
FORMAT_VERSION = 1


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None when it is gone or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _start_s3(address: str, log: Path) -> tuple[int, str]:
    """moto's server on `address` in its own session (it outlives this script); its PID and URL."""
    port = listen_port(address)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", address, "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return proc.pid, f"http://{address}:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                raise RuntimeError(f"the S3 endpoint did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.1)


def record(cluster: SshdCluster, s3_pid: int, s3_url: str) -> dict[str, Any]:
    """What cluster.json holds: everything `down` needs, and what a person needs to use the cluster."""
    return {
        "format_version": FORMAT_VERSION,
        "hosts": [
            {
                "name": h.name,
                "address": h.address,
                "port": h.port,
                "sshd_pid": h.sshd_pid,
                "sshd_start_time": _start_time(h.sshd_pid),
                "netns": h.netns,
                "veth": h.veth,
                "enter": h.enter(["bash"], cwd="/"),
            }
            for h in cluster.hosts
        ],
        "bridge": cluster.bridge,
        "bridge_address": cluster.bridge_address,
        "key_path": str(cluster.key_path),
        "known_hosts_path": str(cluster.known_hosts_path),
        "shared": str(cluster.shared),
        "job_python": cluster.job_python,
        "s3_url": s3_url,
        "s3_pid": s3_pid,
        "s3_start_time": _start_time(s3_pid),
    }


def up(hosts: int, workdir: Path, python: str) -> dict[str, Any]:
    """Start the cluster and the S3 endpoint, write cluster.json and nodes.yaml; the record."""
    if (workdir / CLUSTER_FILE).exists():
        raise SystemExit(f"{workdir / CLUSTER_FILE} exists: a cluster may be up; run `down --dir {workdir}` first")
    missing = missing_prerequisites("netns")
    if missing:
        raise SystemExit(f"a test cluster needs {', '.join(missing)}: run `bash .ci/setup --test` as root")
    specs = [HostSpec(f"node-{i + 1}", python=python) for i in range(hosts)]
    cluster = start_cluster(workdir, specs, network="netns")
    try:
        assert cluster.bridge_address is not None
        s3_pid, s3_url = _start_s3(cluster.bridge_address, workdir / "s3.log")
    except BaseException:
        cluster.close()
        raise
    data = record(cluster, s3_pid, s3_url)
    (workdir / CLUSTER_FILE).write_text(json.dumps(data, indent=2) + "\n")
    (workdir / NODES_FILE).write_text(yaml.safe_dump({"nodes": cluster.nodes_section()}, sort_keys=False))
    return data


def _stop(pid: int, start_time: int | None, grace_s: float = 10.0) -> None:
    """Stop the session `pid` leads, if it is still the process that was recorded."""
    if start_time is None or _start_time(pid) != start_time:
        return  # gone already, or the PID now belongs to someone else
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + grace_s
    while _start_time(pid) == start_time:
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            break
        time.sleep(0.05)


def down(workdir: Path) -> dict[str, Any]:
    """Stop what cluster.json records and remove its namespaces, veths and bridge; the record."""
    path = workdir / CLUSTER_FILE
    if not path.exists():
        raise SystemExit(f"{path} does not exist: nothing recorded to stop")
    data = json.loads(path.read_text())
    for host in data["hosts"]:
        _stop(host["sshd_pid"], host["sshd_start_time"])
    _stop(data["s3_pid"], data["s3_start_time"])
    remove_network([h["netns"] for h in data["hosts"]], [h["veth"] for h in data["hosts"]], data["bridge"])
    path.unlink()
    (workdir / NODES_FILE).unlink(missing_ok=True)
    return data


def _usage(data: dict[str, Any], workdir: Path) -> str:
    first = data["hosts"][0]
    ssh = f"ssh -i {data['key_path']} -o UserKnownHostsFile={data['known_hosts_path']}"
    lines = [f"{h['name']:<8} {h['address']:<15} sshd pid {h['sshd_pid']}  netns {h['netns']}" for h in data["hosts"]]
    return "\n".join(
        [
            *lines,
            "",
            f"log in:         {ssh} root@{first['address']}",
            f"a root shell:   {' '.join(first['enter'])}",
            f"shared folder:  {data['shared']} (the same on every host)",
            f"S3 endpoint:    {data['s3_url']} (any key and secret)",
            f"nodes section:  {workdir / NODES_FILE} (paste into a spec)",
            f"stop it all:    {sys.executable} -m tests.devcluster down --dir {workdir}",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """`up` or `down`, as the module docstring describes."""
    parser = argparse.ArgumentParser(prog="python -m tests.devcluster", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="start the hosts and the S3 endpoint, write DIR/cluster.json")
    start.add_argument("--hosts", type=int, default=3, help="how many hosts (node-1, node-2, ...)")
    start.add_argument("--dir", type=Path, required=True, help="a new or empty folder for keys, logs, records")
    start.add_argument("--python", default=str(Path(sys.executable).absolute()), help="the job Python on the hosts")
    stop = commands.add_parser("down", help="stop what DIR/cluster.json records and remove its namespaces")
    stop.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    workdir = args.dir.absolute()
    if args.command == "up":
        if not 1 <= args.hosts <= 200:
            parser.error(f"--hosts={args.hosts}: use 1 to 200 (one /24 subnet)")
        print(_usage(up(args.hosts, workdir, args.python), workdir))
    else:
        data = down(workdir)
        print(f"stopped {len(data['hosts'])} hosts and the S3 endpoint; removed their namespaces and bridge")


if __name__ == "__main__":
    main()
