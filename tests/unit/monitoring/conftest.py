"""Fixtures of the monitoring unit tests: the files under deployments/monitoring, vLLM's metric names, a scraper."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

MONITORING = Path(__file__).resolve().parents[3] / "deployments" / "monitoring"
# The series of vLLM's OpenAI-compatible server (0.32, v1 engine) that the serving alerts and panels use, as
# Prometheus stores them: vLLM's own (vllm/v1/metrics/loggers.py) and the API server's HTTP counter
# (prometheus-fastapi-instrumentator, which vLLM mounts on /metrics).
VLLM_METRICS = frozenset(
    {
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "http_requests_total",
    }
)


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
def rule_groups() -> dict[str, list[dict[str, Any]]]:
    """The alerting rules of alerts.yml by group name."""
    groups = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    return {group["name"]: [rule for rule in group["rules"] if "alert" in rule] for group in groups}


@pytest.fixture(scope="session")
def alert_rules(rule_groups: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every alerting rule of alerts.yml."""
    return [rule for rules in rule_groups.values() for rule in rules]


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    """The Grafana dashboard."""
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())
