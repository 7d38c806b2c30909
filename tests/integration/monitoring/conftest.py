"""Fixtures of the monitoring integration tests: promtool, free metrics ports, a scraper that waits."""

from __future__ import annotations

import shutil
import socket
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.unit.monitoring.conftest import MONITORING, scrape

__all__ = ["MONITORING", "scrape", "scrape_until"]


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool (Debian's prometheus package)."""
    path = shutil.which("promtool")
    assert path, "promtool missing: bash .ci/setup --test (installs Debian's prometheus package)"
    return path


@pytest.fixture
def metrics_ports() -> Callable[[int], int]:
    """A base port with `n` consecutive ports free on every interface (ranks use base + local rank)."""

    def find(n: int) -> int:
        for _ in range(100):
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", 0))
                base = probe.getsockname()[1]
            if base + n > 65535:
                continue
            try:
                for offset in range(n):
                    with socket.socket() as sock:
                        sock.bind(("0.0.0.0", base + offset))
            except OSError:
                continue
            return base
        raise RuntimeError(f"no {n} consecutive free ports found")

    return find


def scrape_until(port: int, done: Callable[[dict], bool], what: str, timeout_s: float = 120.0) -> dict:
    """Scrape 127.0.0.1:port until `done(samples)`; the samples."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            samples = scrape(port)
            if done(samples):
                return samples
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what} on port {port}")
        time.sleep(0.2)


def port_is_closed(port: int) -> bool:
    """Nothing accepts connections on 127.0.0.1:port."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return True
    return False


def monitoring_file(name: str) -> Path:
    """A file under deployments/monitoring."""
    return MONITORING / name


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that records every JSON body POSTed to it, by path."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        received: list[tuple[str, dict]] = []
        self.received, self._cond = received, threading.Condition()
        cond = self._cond

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with cond:
                    received.append((self.path, json.loads(body or b"null")))
                    cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook-receiver", daemon=True)
        self._thread.start()

    def wait_for(self, done: Callable[[list[tuple[str, dict]]], bool], what: str, timeout_s: float = 60.0) -> list:
        """Wait until `done(received)`; the bodies received so far (TimeoutError naming `what` and them)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not done(self.received):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {what} within {timeout_s} s; received: {self.received}")
                self._cond.wait(left)
            return list(self.received)

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    """A webhook receiver on a free loopback port, stopped after the test."""
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()
