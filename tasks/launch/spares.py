"""Hot spares (cluster.spares): extra torchrun agents that wait in the job's rendezvous and replace a lost node.

torchrun's c10d rendezvous keeps them itself: once a round holds `nodes` participants (--nnodes=N:N), a later
agent joins its redundancy list, which does not count as a node waiting, so the running group is not
restarted for it. When a node is lost, the survivors' workers fail on their next collective, their agents
restart them (max_restarts >= 1) into a new round, and the dead node's heartbeats expire
(SPARE_KEEP_ALIVE): the round has room again and a spare fills it. The world stays `nodes` nodes, the job is
the same job (no requeue) and the trainer records the takeover (training/spares.py, recovery.jsonl).

The local and SSH launchers start a spare's agent only once the job's ranks have met (ranks.json written
since the job was submitted), so that the hosts named spares are the ones left out; where the scheduler starts
every agent at once (Slurm, Kubernetes) the rendezvous picks which `nodes` of them run and the trainer's record
says which did.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import psutil

from training.run_output import RunOutput

SPARE_KEEP_ALIVE = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3}
"""c10d rendezvous heartbeats with spares: a lost node leaves the round after about 3 s instead of 15 s (torch's
default 5 s x 3); measured on this CPU, kill to first step on the spare 5 s instead of 18 s."""

SPARE_WAIT_ENV = "TDEPLOY_SPARE_WAIT"
"""Set on a spare's agent: JSON {"output": folder, "since": submitted unix s, "exits": the nodes' exit files}."""


def spare_nodes(nodes: int, spares: int) -> list[int]:
    """The agent indices of the spares: after the job's own nodes."""
    return list(range(nodes, nodes + spares))


def spare_wait_value(output_dir: Path, submitted_unix_s: float, exit_files: list[Path]) -> str:
    """SPARE_WAIT_ENV's value for a spare agent of the job in `output_dir` whose nodes write `exit_files`."""
    return json.dumps({"output": str(output_dir), "since": round(submitted_unix_s, 3),
                       "exits": [str(p) for p in exit_files]})  # fmt: skip


def _exits_all_written(exit_files: list[str]) -> bool:
    return bool(exit_files) and all(os.path.exists(path) for path in exit_files)


def _has_children() -> bool:
    """This process has started processes that still run (a standby agent has none; a spare at work has its
    workers)."""
    return bool(psutil.Process().children())


def stand_down_when_unneeded(value: str, poll_s: float = 0.5) -> None:
    """In a spare's agent that stands by: exit (0) once every node of the job has exited while this agent runs no
    workers: the job ended without needing it, and torchrun alone would wait for a store that is gone."""
    exit_files = json.loads(value)["exits"]

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if _exits_all_written(exit_files) and not _has_children():
                os._exit(0)

    threading.Thread(target=watch, name="tdeploy-spare-watch", daemon=True).start()


def wait_until_needed(value: str, poll_s: float = 0.2) -> bool:
    """In a spare's agent: wait until the job's ranks have met (True: join the rendezvous as a standby), or
    until every node of the job has exited first (False: the job ended without needing this spare)."""
    wait = json.loads(value)
    since, exit_files, run = float(wait["since"]), wait["exits"], RunOutput(wait["output"])
    while True:
        written = run.ranks_written_at()
        if written is not None and written >= since:
            return True
        if _exits_all_written(exit_files):
            return False
        time.sleep(poll_s)
