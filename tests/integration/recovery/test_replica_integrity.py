"""Live recovery refuses a peer's state that changed after the peer sealed it, and takes the next rung."""

from __future__ import annotations

import http.server
import io
import pickle
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed._serialization import _streaming_save

from tasks.acceptance.ladder.replica_loss import HEALTHY, LOST
from tasks.launch.lighthouse import ReplicaGroupsJob, group_config
from tests.faults import replica_transport
from training.checkpoint.store import CheckpointStore
from training.config import TrainConfig
from training.recovery_record import recovery_events
from training.replica import MAX_REFUSALS

pytestmark = pytest.mark.integration

from training.replica_transport import bound_transport_class

BoundHTTPTransport = bound_transport_class()  # torchft comes with the training extra, which .ci/setup installs

STEPS, SAVE_EVERY, KILL_AT = 40, 5, 8


def _replica_config(make_spec) -> TrainConfig:
    spec = make_spec({"run": {"steps": STEPS, "log_every_steps": 1}, "checkpoint": {"save_every_steps": SAVE_EVERY}})
    raw = spec.training_config().model_dump()
    raw["fault_tolerance"] = {"mode": "replica_groups", "replica_groups": 2, "heartbeat_timeout_s": 1.0,
                              "timeout_s": 5.0}  # fmt: skip
    return TrainConfig.model_validate(raw)


@pytest.mark.parametrize("procs_per_group", [1, 2])  # 2: the group's ranks refuse together (one all-reduce)
def test_a_tampered_peer_state_is_refused_and_the_group_restores_from_storage_then_heals(
    make_spec, tmp_path: Path, procs_per_group: int
) -> None:
    train = _replica_config(make_spec)
    env = replica_transport.environment()
    job = ReplicaGroupsJob.start(train, tmp_path / "groups", procs_per_group, max_restarts=1, env=env)
    try:
        # killed once it has a committed checkpoint (saves are asynchronous): the rung it falls back to
        t_fail = _kill_lost_group_after_a_checkpoint(job, train)
        codes = job.wait(240)
    finally:
        job.stop()
    lost = job.output(LOST)
    assert codes == [0, 0], (job.log_tail(HEALTHY), job.log_tail(LOST))
    events = [e for e in recovery_events(str(lost.dir)) if e.time > t_fail]
    # the first copy the healthy group sent was changed in transit: refused, naming the peer and the step; the
    # group restored its last checkpoint from storage instead, then healed from the peer's next (intact) copy
    assert [e.rung for e in events] == ["storage", "live"], events
    refusal = events[0].refused[0]
    assert refusal.copy.startswith(f"replica group {HEALTHY} at step ") and "digest mismatch" in refusal.reason
    assert events[0].restored_step is not None and events[0].restored_step % SAVE_EVERY == 0
    assert "live recovery refused" in events[0].reason
    assert "refused the state of replica group 0" in job.log_tail(LOST, 200_000)
    # the tampered weight never reached training: both groups end bit-identical
    outputs = [job.output(g) for g in (HEALTHY, LOST)]
    params = [sorted((p.name, p.sha256) for p in out.params()[0].pieces) for out in outputs]
    assert params[0] == params[1]
    assert all(out.result().steps == STEPS for out in outputs)


def _kill_lost_group_after_a_checkpoint(job: ReplicaGroupsJob, train: TrainConfig) -> float:
    """SIGKILL the lost group once it passed KILL_AT with a committed checkpoint; the time of the kill."""
    lost = job.output(LOST)
    saved = CheckpointStore(group_config(train, LOST).checkpoint, train.storage)
    deadline = time.monotonic() + 120
    while not (lost.metric_ranks() and lost.last_step() >= KILL_AT and saved.committed_steps()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in job.groups), job.log_tail(LOST)
        time.sleep(0.1)
    t_fail = time.time()
    job.kill_group(LOST, signal.SIGKILL)
    return t_fail


def test_a_peer_whose_states_keep_failing_stops_the_healing_group_after_max_refusals(
    make_spec, tmp_path: Path
) -> None:
    train = _replica_config(make_spec)
    train = train.model_copy(update={"fault_tolerance": train.fault_tolerance.model_copy(
        update={"quorum_timeout_s": 10.0})})  # fmt: skip
    env = replica_transport.environment(sends=1000)
    job = ReplicaGroupsJob.start(train, tmp_path / "groups", 1, max_restarts=1, env=env)
    try:
        t_fail = _kill_lost_group_after_a_checkpoint(job, train)
        codes = job.wait(300)
    finally:
        job.stop()
    lost, healthy = job.output(LOST), job.output(HEALTHY)
    # the restarted group refused MAX_REFUSALS copies in a row, restoring from storage each time, then gave up;
    # it never loaded a tampered state, and the healthy group finished the job alone
    events = [e for e in recovery_events(str(lost.dir)) if e.time > t_fail]
    assert [e.rung for e in events] == ["storage"] * MAX_REFUSALS, events
    assert all("digest mismatch" in e.refused[0].reason for e in events)
    assert f"refused {MAX_REFUSALS} states in a row" in job.log_tail(LOST, 500_000)
    assert codes[HEALTHY] == 0 and codes[LOST] not in (0, None), (codes, job.log_tail(LOST))
    assert healthy.result().steps == STEPS
    assert [e.attempt for e in recovery_events(str(healthy.dir))] == [0]


def test_the_checkpoint_server_listens_on_the_given_address_and_reads_weights_only(tmp_path: Path) -> None:
    timeout = timedelta(seconds=10)
    transport = BoundHTTPTransport(timeout, "127.0.0.1")
    try:
        assert transport._server.socket.getsockname()[0] == "127.0.0.1"
        assert transport.address().startswith("http://127.0.0.1:")
        state = {"user": {"default": {"w": torch.arange(4.0), "step": 3}}, "torchft": {"step": 3}}
        transport.send_checkpoint([1], 3, state, timeout)
        got = BoundHTTPTransport(timeout, "127.0.0.1")
        try:
            received = got.recv_checkpoint(0, transport.address(), 3, timeout)
        finally:
            got.shutdown()
        assert torch.equal(received["user"]["default"]["w"], torch.arange(4.0))
    finally:
        transport.shutdown()

    # a "peer" that answers with a pickle naming a callable: refused by the weights-only reader, nothing runs
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return (Path.touch, (marker,))

    buf = io.BytesIO()
    _streaming_save({"user": Planted()}, buf)
    payload = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/checkpoint/"
        with pytest.raises(pickle.UnpicklingError):
            BoundHTTPTransport._load_from_address(f"{url}3/full", timeout)
        assert not marker.exists()
    finally:
        server.shutdown()
