"""Fixtures of the monitoring unit tests: the files under deployments/monitoring and a metrics scraper."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

MONITORING = Path(__file__).resolve().parents[3] / "deployments" / "monitoring"


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Samples served on 127.0.0.1:port/metrics, as {sample name: {sorted labels: value}}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


@pytest.fixture(scope="session")
def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of alerts.yml."""
    groups = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    """The Grafana dashboard."""
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())
