"""Run the training payload under torchrun on this machine.

One torchrun agent per (acted-out) node, all meeting at a c10d rendezvous on
127.0.0.1. Agents run in their own process group so that stopping the job ends
exactly its processes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tasks.cluster import ClusterConfig
from training.config import TrainConfig
from training.storage import is_local, local_path

log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    """The training job exited non-zero; `log_tail` holds the end of its output."""

    def __init__(self, returncode: int, log_path: Path, log_tail: str) -> None:
        super().__init__(f"training failed with exit code {returncode}; log: {log_path}\n{log_tail}")
        self.returncode, self.log_path, self.log_tail = returncode, log_path, log_tail


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(cluster: ClusterConfig, config_path: Path, endpoint: str, run_id: str) -> list[str]:
    """The torchrun command line of one agent."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={cluster.nodes}",
        f"--nproc-per-node={cluster.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={cluster.max_restarts}",
        "-m",
        "training.train",
        "--config",
        str(config_path),
    ]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the agents: this one, plus what restarts and CPU threads need."""
    env = dict(os.environ)
    # Restarted gloo workers cannot reconnect to an agent-shared TCP store.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


@dataclass
class LocalJob:
    """A running local training job: its agents and where it writes."""

    agents: list[subprocess.Popen]
    log_path: Path
    output_dir: Path
    log_offset: int = 0
    returncodes: list[int | None] = field(default_factory=list)

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for every agent; the job's exit code is the first non-zero one."""
        self.returncodes = [agent.wait(timeout=timeout_s) for agent in self.agents]
        return next((rc for rc in self.returncodes if rc), 0)

    def follow(self, on_line: Callable[[str], None], poll_s: float = 0.2) -> int:
        """Pass each new line of the log to `on_line` until the job ends; returns its exit code."""
        with open(self.log_path, errors="replace") as handle:
            handle.seek(self.log_offset)
            while True:
                running = any(agent.poll() is None for agent in self.agents)
                for line in handle.readlines():
                    on_line(line.rstrip("\n"))
                if not running:
                    return self.wait()
                time.sleep(poll_s)

    def cancel(self) -> None:
        """SIGTERM the agents' process groups (torchrun forwards it to its workers), then SIGKILL leftovers."""
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)
        for agent in self.agents:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the job's combined log."""
        with open(self.log_path, "rb") as handle:
            handle.seek(self.log_offset)
            text = handle.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def start_local(cluster: ClusterConfig, train: TrainConfig, extra_env: dict[str, str] | None = None) -> LocalJob:
    """Write run.json and start the agents; returns at once."""
    if not is_local(train.run.output_url):
        raise ValueError(
            f"run.output_url={train.run.output_url}: the local launcher needs a local folder for run.json and logs"
        )
    out = Path(local_path(train.run.output_url))
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "run.json"
    train.to_json_file(config_path)
    endpoint = f"127.0.0.1:{cluster.rdzv_port or free_port()}"
    log_path = out / "train.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    log_file = open(log_path, "ab")  # noqa: SIM115 - inherited by the agents, closed below
    agents = []
    try:
        for _ in range(cluster.nodes):
            cmd = torchrun_command(cluster, config_path, endpoint, run_id=out.name or "tdeploy")
            agents.append(
                subprocess.Popen(
                    cmd,
                    env=worker_env(extra_env),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    finally:
        log_file.close()
    log.info("started %d torchrun agent(s) at %s; log %s", len(agents), endpoint, log_path)
    return LocalJob(agents, log_path, out, offset)


def run_local(
    cluster: ClusterConfig,
    train: TrainConfig,
    extra_env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> LocalJob:
    """Run the job to completion, passing each new log line to `on_line`; raises TrainingFailed on failure."""
    job = start_local(cluster, train, extra_env)
    try:
        code = job.follow(on_line) if on_line else job.wait()
    except BaseException:
        job.cancel()
        raise
    if code:
        raise TrainingFailed(code, job.log_path, job.log_tail())
    return job
