"""The torchrun command line and environment shared by every launcher."""

from __future__ import annotations

import os
import socket

from tasks.cluster import ClusterConfig

# Restarted gloo workers cannot reconnect to an agent-shared TCP store.
WORKER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Every rank's stdout and stderr go to files under the log folder, and to the agent's output too.
LOG_ARGS = ["--redirects=3", "--tee=3"]


def agent_args(cluster: ClusterConfig) -> list[str]:
    """The size and restart arguments of one torchrun agent (not the rendezvous endpoint and id)."""
    return [
        f"--nnodes={cluster.nodes}",
        f"--nproc-per-node={cluster.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--max-restarts={cluster.max_restarts}",
    ]


def payload_args(config_path: str) -> list[str]:
    """What torchrun starts on every rank: the training module and its config."""
    return ["-m", "training.train", "--config", config_path]


def torchrun_args(
    cluster: ClusterConfig, endpoint: str, run_id: str, config_path: str, log_dir: str | None = None
) -> list[str]:
    """Arguments after `python -m torch.distributed.run` for one agent."""
    args = [*agent_args(cluster), f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
    if log_dir:
        args += [f"--log-dir={log_dir}", *LOG_ARGS]
    return args + payload_args(config_path)


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus what torchrun workers need, plus `extra` (the spec's env)."""
    env = dict(os.environ)
    for key, value in WORKER_ENV.items():
        env.setdefault(key, value)
    env.update(extra or {})
    return env
