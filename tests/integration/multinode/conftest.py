"""Three test hosts in network namespaces with a shared folder, and a real multi-node Slurm cluster on them.

`hosts3` is tests/integration/nodes/testhosts' cluster of three netns hosts (node-1, node-2, node-3).
`slurm_multinode` runs one munged (in this machine's namespaces: its socket is a path, which every host
reaches), slurmctld inside node-1's namespaces and one slurmd inside each host's namespaces, so that every
job step runs with its host's own host name, address and /etc/hosts. The Slurm client tools run here and
reach slurmctld over the bridge. Only the daemons started here are stopped, by the PID each one wrote.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.nodes.testhosts import HostSpec, SshdCluster, missing_prerequisites, start_cluster
from tests.processes import daemon_pid, forget_daemon, track_daemon

HOST_NAMES = ("node-1", "node-2", "node-3")
CTLD_PORT = 6817  # every host has its own network namespace: the standard ports are free there
SLURMD_PORT = 6818

SLURM_CONF = """\
ClusterName=tdeploy-multinode
SlurmctldHost={ctld_host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge}/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
MailProg=/bin/true
MinJobAge=600
ReturnToService=2
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmMultinode:
    """A running multi-node Slurm cluster: the hosts it runs on, the client environment, its folder."""

    hosts: SshdCluster
    env: dict[str, str]  # for the client tools and SlurmLauncher: SLURM_CONF
    root: Path  # slurm.conf, state, spool and logs of every daemon

    def sinfo_states(self) -> dict[str, str]:
        """Each node's state as sinfo shows it (idle, alloc, down, ...)."""
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], env=dict(os.environ, **self.env), capture_output=True, text=True
        )
        return dict(line.split() for line in proc.stdout.splitlines() if line.strip())

    def logs(self) -> str:
        """The tail of every daemon's log, for failure messages."""
        logs = sorted(self.root.glob("*.log"))
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs)


def require_netns() -> None:
    """Fail (not skip) when this machine cannot start test hosts: the tests need them."""
    missing = missing_prerequisites("netns")
    missing += [t for t in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(t)]
    if missing:
        pytest.fail(f"multi-node tests need {', '.join(missing)}: run `bash .ci/setup --test` as root")


@pytest.fixture(scope="module")
def hosts3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Three hosts in network namespaces (node-1..3) with .venv/bin/python as the job Python and a shared folder."""
    require_netns()
    cluster = start_cluster(tmp_path_factory.mktemp("hosts3"), [HostSpec(n) for n in HOST_NAMES], network="netns")
    try:
        yield cluster
    finally:
        cluster.close()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


@pytest.fixture(scope="module")
def slurm_multinode(hosts3: SshdCluster) -> Iterator[SlurmMultinode]:
    """munged, slurmctld on node-1 and a slurmd on every host, all nodes idle; stopped by PID afterwards."""
    # munged runs as user munge, which cannot enter pytest's private (0700) temporary folders
    munge = Path(tempfile.mkdtemp(prefix="tdeploy-munge-"))
    root = hosts3.workdir / "slurm"
    (root / "state").mkdir(parents=True)
    for host in hosts3.hosts:
        (root / f"spool-{host.name}").mkdir()
    first = hosts3.hosts[0]
    nodes = "\n".join(
        f"NodeName={h.name} NodeAddr={h.address} CPUs={os.cpu_count() or 2} RealMemory=1000 State=UNKNOWN"
        for h in hosts3.hosts
    )
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            ctld_host=first.name, ctld_addr=first.address, ctld_port=CTLD_PORT, slurmd_port=SLURMD_PORT,
            munge=munge, root=root, nodes=nodes, node_list=",".join(h.name for h in hosts3.hosts),
        )
    )  # fmt: skip
    env = {"SLURM_CONF": str(conf)}
    full_env = dict(os.environ, **env)
    cluster = SlurmMultinode(hosts3, env, root)
    pending: list[Path] = []  # pid files of daemons being started and not yet recorded in pids
    pids: list[int] = []

    def start(argv: list[str], pid_file: Path, log: Path) -> None:
        pending.append(pid_file)
        proc = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=60)  # it forks, returns
        if proc.returncode != 0:
            raise RuntimeError(f"{argv} exited {proc.returncode}: {proc.stderr.strip()}\n{_tail(log)}")
        pids.append(daemon_pid(pid_file, log=log))
        track_daemon(pids[-1], pid_file.name)
        pending.remove(pid_file)

    try:
        os.chmod(munge, 0o755)
        subprocess.run(["mungekey", "--create", f"--keyfile={munge}/munge.key", "--force"], check=True)
        shutil.chown(munge, "munge", "munge")
        shutil.chown(munge / "munge.key", "munge", "munge")
        start(
            ["runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={munge}/munge.sock",
             f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed"],
            munge / "munged.pid", munge / "munged.log",
        )  # fmt: skip
        ctld = first.enter(["/usr/sbin/slurmctld", "-f", str(conf), "-c"])
        start(ctld, root / "slurmctld.pid", root / "slurmctld.log")
        for host in hosts3.hosts:
            start(
                host.enter(["/usr/sbin/slurmd", "-f", str(conf), "-N", host.name]),
                root / f"slurmd-{host.name}.pid",
                root / f"slurmd-{host.name}.log",
            )
        deadline = time.monotonic() + 60
        while set((states := cluster.sinfo_states()).values()) != {"idle"} or len(states) != len(hosts3.hosts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm nodes never all became idle: {states}\n{cluster.logs()}")
            time.sleep(0.3)
        yield cluster
    finally:
        # A daemon whose start was interrupted (a timeout) may have written its pid file without being recorded.
        for pid_file in pending:
            if pid_file.exists() and pid_file.read_text().strip():
                pids.append(int(pid_file.read_text().split()[0]))
        for pid in reversed(pids):  # exactly the daemons started here (they detach: no group to stop)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            forget_daemon(pid)
        _wait_gone(pids)
        shutil.rmtree(munge, ignore_errors=True)


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> None:
    """Wait until these daemons have exited (so that the hosts' namespaces can go)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
