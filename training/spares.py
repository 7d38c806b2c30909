"""Hot-spare takeovers as the trainer sees them: which agents (nodes) ran the job before a restart and which now.

Every rank names its torchrun agent in ranks.json (`agent`: host and the agent's pid, the worker's parent). At a
start, rank 0 compares the agents of the ranks.json the previous attempt wrote with its own: some agents stayed
(the same job went on: not a relaunch), some left and as many joined (spares took the lost nodes' places). Such
a start appends a RecoveryEvent with rung "spare" to recovery.jsonl saying which agent took which one's place;
the rung that restored the state (memory or storage) has its own event from the same start.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any

from training.config import TrainConfig
from training.recovery_record import RecoveryEvent, append_event
from training.run_output import RANKS, RESULT
from training.storage import StorageConfig, filesystem, join, read_control_file

log = logging.getLogger(__name__)

AGENT_KEY = "agent"
"""The key of a rank's agent in its ranks.json record."""
NODE_KEY = "node"
"""The key of a rank's node (torchrun's GROUP_RANK in this round) in its ranks.json record."""


def agent_record() -> dict[str, Any]:
    """This worker's agent (`host:pid` of its parent, the torchrun agent) and node, for its ranks.json record."""
    return {AGENT_KEY: f"{socket.gethostname()}:{os.getppid()}", NODE_KEY: int(os.environ.get("GROUP_RANK", 0))}


def _agents(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """Agent -> node of the ranks that name one (older ranks.json files do not)."""
    return {str(r[AGENT_KEY]): int(r.get(NODE_KEY, 0)) for r in ranks if isinstance(r, dict) and r.get(AGENT_KEY)}


def takeover(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> dict[str, str]:
    """What spares took over between two rounds of the same job: {"node N": "<agent> in place of <agent>"}; empty
    when no agent left, when none joined, or when none stayed (a new job, not a takeover)."""
    before, now = _agents(previous), _agents(current)
    lost = sorted((node, agent) for agent, node in before.items() if agent not in now)
    joined = sorted((node, agent) for agent, node in now.items() if agent not in before)
    if not lost or not joined or len(lost) + len(now) - len(joined) != len(before) or not set(before) & set(now):
        return {}
    return {f"node {node}": f"spare {agent} in place of {gone}" for (node, agent), (_, gone) in zip(joined, lost)}


def previous_ranks(output_url: str, storage: StorageConfig | None) -> list[dict[str, Any]]:
    """The rank records of the ranks.json already in the run folder ([] when there is none or it is unreadable:
    no takeover is then reported)."""
    fs, root = filesystem(output_url, storage)
    try:
        data = json.loads(read_control_file(fs, join(root, RANKS)))
    except FileNotFoundError:
        return []
    except ValueError as err:
        log.warning("ranks.json of %s unreadable (%s): a spare takeover would go unrecorded", output_url, err)
        return []
    ranks = data.get("ranks") if isinstance(data, dict) else None
    return ranks if isinstance(ranks, list) else []


def job_finished_since(config_path: str | None, since_unix_s: float) -> bool:
    """Whether the job whose run.json is `config_path` wrote its result (result.json) since `since_unix_s`: a
    standby agent whose rendezvous store went away with the finished job has nothing left to do (exit 0)."""
    if config_path is None:
        return False
    try:
        cfg = TrainConfig.from_json_file(config_path)
        fs, root = filesystem(cfg.run.output_url, cfg.storage)
        modified = fs.modified(join(root, RESULT))
    except (OSError, ValueError, NotImplementedError):  # no result (yet), or unreadable: not finished
        return False
    return modified.timestamp() >= since_unix_s


def record_takeover(
    output_url: str,
    storage: StorageConfig | None,
    previous: list[dict[str, Any]],
    current: list[dict[str, Any]],
    restored_step: int | None,
) -> RecoveryEvent | None:
    """On rank 0 at a start: append the "spare" event when spares took lost nodes' places (None otherwise)."""
    source = takeover(previous, current)
    if not source:
        return None
    event = RecoveryEvent(
        "spare", restored_step, len(current), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), source,
        reason=f"{len(source)} node(s) lost; hot spare(s) joined the same job's rendezvous",
    )  # fmt: skip
    append_event(output_url, event, storage)
    log.warning("hot spare takeover: %s", "; ".join(f"{k}: {v}" for k, v in source.items()))
    return event
