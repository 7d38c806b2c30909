"""A real single-node Slurm cluster (munged, slurmctld, slurmd) started without systemd for the session."""

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
AuthInfo=socket={munge}/munge.sock
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
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and slurmd on private sockets, ports and state; yields the client environment."""
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
            root=root, munge=munge, ctld_port=free_port(), slurmd_port=free_port(), cpus=os.cpu_count() or 2
        )
    )
    env = {"SLURM_CONF": str(conf)}
    full_env = dict(os.environ, **env)
    pid_files: list[Path] = []  # of daemons being started and not yet recorded in pids
    pids: list[int] = []

    def started(pid_file: Path) -> None:
        pids.append(daemon_pid(pid_file, 15.0))
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
        started(munge / "munged.pid")
        pid_files.append(root / "slurmctld.pid")
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(conf), "-c"], check=True, env=full_env, timeout=60)
        started(root / "slurmctld.pid")
        pid_files.append(root / "slurmd.pid")
        subprocess.run(["/usr/sbin/slurmd", "-f", str(conf), "-N", "localhost"], check=True, env=full_env, timeout=60)
        started(root / "slurmd.pid")
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
