"""A checkpoint save held by an S3 endpoint that stops answering (a real S3 server behind a proxy that holds every
byte): the caller held by it is warned, again and again, naming the storage and how long it has been held, and the
save's record counts the time the caller really waited as 'training held'."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import warnings

import pytest
import torch

import training.checkpoint.manager as saving
from tasks.acceptance.outage import TcpProxy
from training.checkpoint import KEY_ENV, CheckpointManager, step_dir_name
from training.config import CheckpointConfig
from training.storage import StorageConfig

pytestmark = pytest.mark.integration


class StallingProxy(TcpProxy):
    """A TcpProxy whose endpoint can stop answering: while stalled, connections open and stay open but no byte
    passes either way (a hung server or a black-holed route, not a refused connection)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.flowing = threading.Event()
        self.flowing.set()
        super().__init__(target_host, target_port)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class _Warnings(logging.Handler):
    """Collects the held-save warnings with the moment (perf_counter) each was logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[tuple[float, str]] = []
        self.second = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "held" in record.getMessage():
            self.seen.append((time.perf_counter(), record.getMessage()))
            if len(self.seen) >= 2:
                self.second.set()


def test_a_save_held_by_storage_that_stops_answering_is_warned_about_and_counted_as_training_held(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    monkeypatch.setattr(saving, "SAVE_HELD_WARN_AFTER_S", 0.2)
    monkeypatch.setattr(saving, "SAVE_HELD_WARN_EVERY_S", 0.2)
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = StallingProxy(host, int(port))
    heard = _Warnings()
    logging.getLogger("training.checkpoint").addHandler(heard)
    try:
        url = f"s3://{s3_bucket}/ckpt"
        manager = CheckpointManager(CheckpointConfig(url=url), StorageConfig(s3_endpoint_url=proxy.url))
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        proxy.flowing.clear()  # the endpoint stops answering before the save reaches it
        manager.save_async(1, model, optimizer, {"step": 1})
        released: list[float] = []

        def answer_again() -> None:  # once the caller has been warned twice
            heard.second.wait(timeout=120)
            released.append(time.perf_counter())
            proxy.flowing.set()

        threading.Thread(target=answer_again, daemon=True).start()
        saved = manager.wait()
        committed = manager.read_commit(1)
    finally:
        proxy.flowing.set()
        proxy.close()
        logging.getLogger("training.checkpoint").removeHandler(heard)

    assert saved is not None and saved.step == 1 and committed is not None  # the save went on
    assert len(heard.seen) >= 2, heard.seen
    where = f"{url}/{step_dir_name(1)} (endpoint {proxy.url})"
    for _, message in heard.seen:
        assert "training has been held " in message and f"by the checkpoint save of step 1 to {where}" in message
        assert "the storage is slow or not answering" in message
    # wait() began before its first warning and returned after the endpoint answered again: 'training held'
    # counts at least that much (it said 0.00s, the staging copy only, before)
    first_warning = heard.seen[0][0]
    assert released and saved.stall_s > released[0] - first_warning, (saved.stall_s, released[0] - first_warning)
