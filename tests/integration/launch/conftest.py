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


def _pid(path: Path, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.1)
    return int(path.read_text().split()[0])


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
    pids: list[int] = []
    try:
        subprocess.run(
            ["runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={munge}/munge.sock",
             f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed"],
            check=True,
        )  # fmt: skip
        pids.append(_pid(munge / "munged.pid"))
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(conf), "-c"], check=True, env=full_env)
        pids.append(_pid(root / "slurmctld.pid"))
        subprocess.run(["/usr/sbin/slurmd", "-f", str(conf), "-N", "localhost"], check=True, env=full_env)
        pids.append(_pid(root / "slurmd.pid"))
        deadline = time.monotonic() + 30
        while (
            "idle"
            not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=full_env, capture_output=True, text=True).stdout
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the Slurm node never became idle: " + (root / "slurmctld.log").read_text()[-2000:])
            time.sleep(0.3)
        yield env
    finally:
        for pid in reversed(pids):  # exactly the daemons this fixture started
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        shutil.rmtree(munge, ignore_errors=True)
