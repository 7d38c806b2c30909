"""Fixtures of the monitoring integration tests: promtool, free metrics ports, a scraper that waits."""

from __future__ import annotations

import shutil
import socket
import time
import urllib.error
from collections.abc import Callable
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
