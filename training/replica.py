"""Live recovery of a lost data-parallel replica group (rung 1 of the recovery ladder), with torchft.

With `fault_tolerance.mode: replica_groups` every node runs its own torchrun job (a replica group, own rendezvous,
own run output and checkpoints) and a torchft lighthouse (started by the launcher: tasks/launch/lighthouse.py)
forms a quorum of the live groups at every step. Inside a group DDP averages the gradients as usual; across
groups `ReplicaGroup.sync_gradients` averages them over the quorum's participants, and a step is committed only
when the groups agree (`should_commit`). A group whose process dies is restarted by its torchrun
(cluster.max_restarts); the restarted group reads no storage: it joins the next quorum behind the others and pulls
the model, optimizer and training state from a healthy group over torchft's checkpoint transport (HTTP), while the
healthy groups go on without reloading. While a group is missing, the others train on their own shards of the
global batch (the missing group's samples of those steps are skipped) and average over the groups present.

The state crosses the network sealed (training/replica_integrity.py: a SHA-256, or an HMAC under
TDEPLOY_CHECKPOINT_KEY, over every tensor and the train state), is read weights-only from a server bound to the
launcher's address (training/replica_transport.py), and is loaded only when its seal verifies. A copy that fails
is refused (logged with the peer and the step): the group restores through the trainer's next rungs (memory,
storage), records the refusal in recovery.jsonl, drops that step, and heals from a peer at the next quorum (the
healthy groups' collective of that step times out after fault_tolerance.timeout_s and is trained again);
MAX_REFUSALS refusals in a row stop the group.

torchft is imported only here, and only when the mode is on: the trainer runs without it otherwise.

Each group's rank 0 writes `<output>/replica.jsonl` (one QuorumEvent when the participants change or the group
heals: the evidence the replica_loss drill reads) and appends a RecoveryEvent with rung "live" to recovery.jsonl
(training/recovery_record.py) when it healed from a peer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.config import FaultToleranceConfig
from training.job_env import HOST_ENV, LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from training.recovery_record import RecoveryEvent, Refusal, append_event
from training.replica_integrity import PeerStateRefused, open_sealed, seal
from training.storage import StorageConfig, filesystem, join, read_control_file, write_bytes_atomic

log = logging.getLogger(__name__)

REPLICA_FILE = "replica.jsonl"
MAX_REFUSALS = 3
"""Refused copies in a row after which the group stops (ReplicaGroupError) instead of trying its peers again."""


class ReplicaGroupError(RuntimeError):
    """The replica-group mode cannot start here (torchft missing, or the launcher's variables unset)."""


@dataclass(frozen=True)
class QuorumEvent:
    """One line of replica.jsonl: the quorum this group trained a step in changed, or the group healed."""

    time: float
    step: int
    """The step this group was about to train (after a heal: the step it pulled from the peer)."""
    participants: int
    healed: bool
    attempt: int
    restore_s: float = 0.0


def group_index(groups: int) -> int:
    """This process's replica group, from TDEPLOY_REPLICA_GROUP (ReplicaGroupError when unset or out of range)."""
    raw = os.environ.get(REPLICA_GROUP_ENV)
    if raw is None or not raw.isdigit() or int(raw) >= groups:
        raise ReplicaGroupError(
            f"{REPLICA_GROUP_ENV}={raw!r} is not a replica group of fault_tolerance.replica_groups={groups}; "
            "start the job through a launcher that runs replica groups (tasks/launch/lighthouse.py)"
        )
    return int(raw)


def restarted() -> bool:
    """This process is a restart of its group's workers (torchrun's TORCHELASTIC_RESTART_COUNT > 0)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def quorum_events(output_url: str, storage: StorageConfig | None = None) -> list[QuorumEvent]:
    """The quorum events of one replica group's output folder, oldest first ([] when none)."""
    fs, root = filesystem(output_url, storage)
    try:
        raw = read_control_file(fs, join(root, REPLICA_FILE))
    except FileNotFoundError:
        return []
    return [QuorumEvent(**json.loads(line)) for line in raw.decode().splitlines() if line.strip()]


class ReplicaGroup:
    """This group's place in the torchft quorum: quorum and heal at each step, the cross-group gradient average,
    and the commit vote."""

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        group: int,
        device: torch.device,
        state: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
        fallback: Callable[[list[Refusal], str], int],
        output_url: str,
        storage: StorageConfig,
    ) -> None:
        try:
            from torchft import Manager  # noqa: PLC0415 - an optional dependency, for this mode only
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL  # noqa: PLC0415
        except ImportError as err:
            raise ReplicaGroupError(
                f"fault_tolerance.mode=replica_groups needs torchft ({err}); install the training extra "
                "(pip install 'transformer-deploy[training]') or set fault_tolerance.mode=none"
            ) from err
        lighthouse = os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ReplicaGroupError(
                f"{LIGHTHOUSE_ENV} is unset: replica groups need the lighthouse the launcher starts "
                "(tasks/launch/lighthouse.py)"
            )
        host = os.environ.get(HOST_ENV)
        if not host:
            raise ReplicaGroupError(
                f"{HOST_ENV} is unset: replica groups need the address the launcher's rendezvous uses "
                "(tasks/launch/lighthouse.py sets it)"
            )
        from training.replica_transport import bound_transport_class  # noqa: PLC0415 - torchft, in this mode only

        self.group, self.output_url, self.storage, self.device = group, output_url, storage, device
        self.groups, self.quorum_timeout_s = cfg.replica_groups, cfg.quorum_timeout_s
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._state, self._load, self._fallback, self._healed_s = state, load, fallback, None
        self._refused: PeerStateRefused | None = None
        self._refusals = 0  # in a row: reset by a heal that verifies
        timeout = timedelta(seconds=cfg.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        # The group's own store (MASTER_ADDR/MASTER_PORT of its torchrun) carries the manager's address to its ranks.
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load_state,
            state_dict=self._sealed_state,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=False,  # heal before the forward pass: the step then trains on the pulled state
            init_sync=False,  # every group builds the same initial weights from run.seed
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timeout,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{group}",
            hostname=host,  # advertised to the lighthouse; torchft 0.2.0 binds the manager server to [::] itself
            checkpoint_transport=bound_transport_class()(timeout, host),
        )
        self._participants: int | None = None
        self.rank0 = int(os.environ.get("RANK", "0")) == 0

    def _sealed_state(self) -> dict[str, Any]:
        """What a healing group pulls from this one: the trainer's state, sealed (training/replica_integrity.py)."""
        return seal(self._state(), f"replica group {self.group}", self.manager.current_step())

    def _load_state(self, received: dict[str, Any]) -> None:
        """Load a healthy group's state once its seal verifies. A copy that fails is not loaded: this group restores
        through the trainer's next rungs (memory, storage), records the refusal, and drops this step (torchft's
        report_error), so that the next quorum heals it again from a peer; after MAX_REFUSALS in a row it raises
        ReplicaGroupError (an infrastructure failure: torchrun restarts the group, or the job fails)."""
        started = time.perf_counter()
        try:
            opened, err = open_sealed(received), None
        except PeerStateRefused as refused:
            opened, err = None, refused
            log.error("replica group %d rank %s: %s; restoring through the next rung", self.group,
                      os.environ.get("RANK", "0"), err)  # fmt: skip
        # Every rank of the group heals at once, each from its own copy: they fall back together or not at all.
        if dist.is_available() and dist.is_initialized():
            bad = torch.tensor([int(err is not None)], device=self.device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if err is None and bad.item():
                err = PeerStateRefused(opened.peer, opened.step, "another rank of this group refused its copy")
        if err is not None:
            self._refused, self._refusals = err, self._refusals + 1
            refusal = Refusal(f"{err.peer} at step {err.step} (live recovery)", err.reason)
            self.set_step(self._fallback([refusal], f"live recovery refused the state of {err.peer}: {err.reason}"))
            if self._refusals >= MAX_REFUSALS:
                raise ReplicaGroupError(
                    f"replica group {self.group} refused {self._refusals} states in a row from its peers (last: "
                    f"{err}); check that every replica group runs the same code with the same TDEPLOY_CHECKPOINT_KEY "
                    "and the network between them"
                ) from err
            self.manager.report_error(err)
            return
        assert opened is not None
        self._load(opened.state)
        self._refusals = 0
        self._healed_s = time.perf_counter() - started

    def set_step(self, step: int) -> None:
        """Tell the quorum where this group stands (after a storage resume at start-up)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self, last: bool = False) -> None:
        """Join this step's quorum; a group behind the others pulls the state of a healthy one here. The first step
        of a fresh job and the `last` step wait for every group (up to quorum_timeout_s): the lighthouse forms a
        quorum of whoever asks, so a group that started first would train alone, and a group restarting while
        the others finish would find no peer to pull from."""
        started = time.perf_counter()
        self._healed_s, self._refused = None, None
        self.manager.start_quorum()
        participants = self.manager.num_participants()
        first = self._participants is None and self.attempt == 0
        if (first or last) and participants < self.groups:
            participants = self._wait_for_all(participants, give_up=not first)
        healed = self._healed_s is not None
        if (self._participants is None and self.attempt > 0 and not healed and self._refused is None
                and self.manager.current_step() == 0):
            # No group was ahead of this restarted one: every group was lost. The trainer's own rungs (memory,
            # storage) restore; groups that restored an older step heal from the newest at the next quorum.
            log.warning("replica group %d: no replica group to pull from; restoring through the next rung", self.group)
            self.set_step(self._fallback([], "no replica group to pull from"))
        if healed or participants != self._participants:
            step = self.manager.current_step()
            event = QuorumEvent(time.time(), step, participants, healed, self.attempt,
                                time.perf_counter() - started if healed else 0.0)  # fmt: skip
            if self.rank0:
                self._record(event)
            if healed:
                log.info("replica group %d healed from a peer at step %d in %.2f s", self.group, step, event.restore_s)
            elif self._participants is not None:
                log.warning("replica group %d: %d groups in the quorum at step %d (were %d)",
                            self.group, participants, step, self._participants)  # fmt: skip
        self._participants = participants

    def _wait_for_all(self, participants: int, give_up: bool) -> int:
        """Ask for quorums until every group is in one; past quorum_timeout_s go on without them (`give_up`) or
        raise."""
        deadline = time.monotonic() + self.quorum_timeout_s
        while participants < self.groups:
            if time.monotonic() > deadline:
                if give_up:
                    log.warning("replica group %d: %d of %d groups at the last step after %g s; finishing without "
                                "the others", self.group, participants, self.groups, self.quorum_timeout_s)  # fmt: skip
                    return participants
                raise ReplicaGroupError(
                    f"only {participants} of fault_tolerance.replica_groups={self.groups} replica groups joined "
                    f"within quorum_timeout_s={self.quorum_timeout_s:g}; see the other groups' logs"
                )
            time.sleep(0.05)
            self.manager.start_quorum()
            participants = self.manager.num_participants()
        return participants

    def _record(self, event: QuorumEvent) -> None:
        fs, root = filesystem(self.output_url, self.storage)
        path = join(root, REPLICA_FILE)
        try:
            old = read_control_file(fs, path)
        except FileNotFoundError:
            old = b""
        write_bytes_atomic(fs, path, old + (json.dumps(asdict(event)) + "\n").encode())
        if event.healed:
            append_event(self.output_url, RecoveryEvent(
                rung="live", restored_step=event.step, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                attempt=self.attempt, source={f"replica group {self.group}": "pulled from a healthy replica group"},
                restore_s=event.restore_s, reason="a healthy replica group was ahead in the quorum",
            ), self.storage)  # fmt: skip

    def sync_gradients(self, model: nn.Module) -> None:
        """Average the gradients over the groups in the quorum (one flat all-reduce)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def should_commit(self) -> bool:
        """Whether every group may apply this step (False after a failed collective: the step is retried)."""
        return self.manager.should_commit()

    def shutdown(self) -> None:
        """Stop the manager's server and its checkpoint transport."""
        self.manager.shutdown(wait=False)

