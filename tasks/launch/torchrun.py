"""The torchrun command line and environment shared by every launcher."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from tasks.launch.network import network_env
from tasks.launch.spares import SPARE_KEEP_ALIVE
from training.network import listen_port
from training.worker_start import WORKER_START_ENV

if TYPE_CHECKING:
    from tasks.launch.cluster import ClusterConfig
    from tasks.launch.environment import JobEnvironment

# Restarted gloo workers cannot reconnect to an agent-shared TCP store.
WORKER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the ephemeral range (training.network.listen_port says why)."""
    return listen_port()


# Every rank's stdout and stderr go to files under the log folder, and to the agent's output too.
LOG_ARGS = ["--redirects=3", "--tee=3"]


def rdzv_conf_args(cluster: ClusterConfig, backend: str = "c10d", is_host: bool | None = None) -> list[str]:
    """`--rdzv-conf` with cluster.network.rdzv_timeout_s, by the name the backend reads: c10d's join_timeout, the
    static rendezvous' timeout (the Kubeflow training operator's default); nothing when it is not set."""
    timeout = cluster.network.rdzv_timeout_s
    conf = [] if timeout is None else [f"{'timeout' if backend == 'static' else 'join_timeout'}={timeout:d}"]
    if cluster.spares and backend == "c10d":  # a lost node must leave the rendezvous soon for a spare to join
        conf += [f"{key}={value:d}" for key, value in SPARE_KEEP_ALIVE.items()]
    if is_host is not None:  # who hosts the c10d store, where more than one agent could (agents on one machine)
        conf.append(f"is_host={int(is_host)}")
    return [f"--rdzv-conf={','.join(conf)}"] if conf else []


# torchrun's own signals plus Slurm's warning signal: without it in the list, SIGUSR1 kills the agent.
PREEMPTION_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def preemption_args(cluster: ClusterConfig) -> list[str]:
    """torchrun passes SIGTERM and SIGUSR1 on to its workers and waits up to cluster.preemption.grace_period_s
    for them (its default is 30 s, then SIGKILL) before it exits; nothing when preemption is off."""
    if not cluster.preemption.enabled:
        return []
    return [
        f"--signals-to-handle={PREEMPTION_SIGNALS_TO_HANDLE}",
        f"--shutdown-timeout={cluster.preemption.grace_period_s:d}",
    ]


def agent_args(cluster: ClusterConfig, is_host: bool | None = None) -> list[str]:
    """The size, restart, rendezvous-timeout and signal arguments of one torchrun agent (not the endpoint and id);
    `is_host`: whether it hosts the rendezvous store (None: torchrun decides, by the endpoint's address)."""
    return [
        f"--nnodes={cluster.nodes}" if cluster.min_nodes is None else f"--nnodes={cluster.min_nodes}:{cluster.nodes}",
        f"--nproc-per-node={cluster.procs_per_node}",
        "--rdzv-backend=c10d",
        *rdzv_conf_args(cluster, is_host=is_host),
        f"--max-restarts={cluster.max_restarts}",
        *preemption_args(cluster),
    ]


def payload_args(config_path: str) -> list[str]:
    """What torchrun starts on every rank: the training module and its config."""
    return ["-m", "training.train", "--config", config_path]


def torchrun_args(
    cluster: ClusterConfig,
    endpoint: str,
    run_id: str,
    config_path: str,
    log_dir: str | None = None,
    is_host: bool | None = None,
) -> list[str]:
    """Arguments after `python -m torch.distributed.run` for one agent (`is_host`: see agent_args)."""
    args = [*agent_args(cluster, is_host), f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
    if log_dir:
        args += [f"--log-dir={log_dir}", *LOG_ARGS]
    return args + payload_args(config_path)


def job_env(
    cluster: ClusterConfig, environment: JobEnvironment | None = None, inherited: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The job's environment: `inherited` (where its processes start from), the workers' defaults where unset
    there, then the spec's cluster.env and cluster.network (which never set the same name), then `environment`'s
    variables (a drill's points, a test plugin: tasks/launch/environment.py). A CPU job's agents fork their
    workers with the payload imported (training/worker_start.py); a GPU job's start each as a new interpreter."""
    env = dict(inherited or {})
    for key, value in WORKER_ENV.items():
        env.setdefault(key, value)
    if cluster.accelerator == "cpu":  # workers forked from their agent, the payload imported (worker_start.py)
        env.setdefault(WORKER_START_ENV, "fork")
    extra = environment.variables() if environment is not None else {}
    return {**env, **cluster.env, **network_env(cluster.network), **extra}
