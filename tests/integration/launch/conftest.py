"""A real single-node Slurm cluster (munged, slurmctld, slurmd) started without systemd for the session.

Besides the default partition `debug` it has a priority pool over the same node: a job in `high` preempts one
in `low` (partition_prio, PreemptMode=REQUEUE): Slurm sends the low job's tasks SIGCONT and SIGTERM, kills what
is left after `low`'s GraceTime and requeues it; it starts again by itself when the node is free, after
cred_expire seconds. Both are Hidden so that `sinfo` and the launcher's partition hints still offer `debug`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import daemon_pid, forget_daemon, track_daemon

SLURM_CONF = """\
ClusterName=tdeploy-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge}/munge.sock,cred_expire={cred_expire_s}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
EnforcePartLimits=ALL
MailProg=/bin/true
MinJobAge=600
ReturnToService=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
SchedulerParameters=bf_interval=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
PartitionName=low Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={grace_time_s} Hidden=YES
PartitionName=high Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=10 Hidden=YES
"""
PREEMPTION_GRACE_TIME_S = 60
"""`low`'s GraceTime: the trainer's step, checkpoint save and exit must fit; a tiny model needs a few seconds."""
REQUEUE_DELAY_S = 5
"""cred_expire: how long a requeued job waits before it may start again (Slurm's default 120 s is too slow); the
backfill scheduler, run every 2 s (bf_interval) instead of 30, starts it soon after."""


def slurm_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and slurmd on private sockets, ports and state; yields the client environment (the
    session fixture `slurm_cluster` in tests/integration/conftest.py, shared by the launcher's and the recovery
    drills' tests)."""
    for tool in ("munged", "slurmctld", "slurmd", "sbatch"):
        assert shutil.which(tool) or Path(f"/usr/sbin/{tool}").exists(), f"{tool} missing: bash .ci/setup --test"
    from tasks.launch.torchrun import free_port

    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    # munged runs as user munge, which cannot enter pytest's private (0700) temporary folders
    munge = Path(tempfile.mkdtemp(prefix="tdeploy-munge-"))
    os.chmod(munge, 0o755)
    subprocess.run(["mungekey", "--create", f"--keyfile={munge}/munge.key", "--force"], check=True)
    shutil.chown(munge, "munge", "munge")
    shutil.chown(munge / "munge.key", "munge", "munge")
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            root=root,
            munge=munge,
            ctld_port=free_port(),
            slurmd_port=free_port(),
            cpus=os.cpu_count() or 2,
            cred_expire_s=REQUEUE_DELAY_S,
            grace_time_s=PREEMPTION_GRACE_TIME_S,
        )
    )
    env = {"SLURM_CONF": str(conf)}
    full_env = dict(os.environ, **env)
    pid_files: list[Path] = []  # of daemons being started and not yet recorded in pids
    pids: list[int] = []

    def started(pid_file: Path, log: Path | None = None) -> None:
        pids.append(daemon_pid(pid_file, 30.0, log))
        track_daemon(pids[-1], pid_file.name)
        pid_files.remove(pid_file)

    try:
        pid_files.append(munge / "munged.pid")
        subprocess.run(
            ["runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={munge}/munge.sock",
             f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed"],
            check=True, timeout=60,
        )  # fmt: skip
        started(munge / "munged.pid", munge / "munged.log")
        pid_files.append(root / "slurmctld.pid")
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(conf), "-c"], check=True, env=full_env, timeout=60)
        started(root / "slurmctld.pid", root / "slurmctld.log")
        pid_files.append(root / "slurmd.pid")
        subprocess.run(["/usr/sbin/slurmd", "-f", str(conf), "-N", "localhost"], check=True, env=full_env, timeout=60)
        started(root / "slurmd.pid", root / "slurmd.log")
        deadline = time.monotonic() + 30
        while (
            "idle"
            not in subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=full_env, capture_output=True, text=True, timeout=30
            ).stdout
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the Slurm node never became idle: " + (root / "slurmctld.log").read_text()[-2000:])
            time.sleep(0.3)
        yield env
    finally:
        # A daemon whose start was interrupted (a timeout) may have written its pid file without being recorded.
        for pid_file in pid_files:
            if pid_file.exists() and pid_file.read_text().strip():
                pids.append(int(pid_file.read_text().split()[0]))
        for pid in reversed(pids):  # exactly the daemons this fixture started (they detach: no group to stop)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            forget_daemon(pid)
        shutil.rmtree(munge, ignore_errors=True)
