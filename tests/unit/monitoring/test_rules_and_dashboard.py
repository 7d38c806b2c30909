"""The alert rules and the Grafana dashboard use only what the exporter serves, and cover all of it."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import pytest

from tests.unit.monitoring.promql import metric_names
from training.telemetry import EXPORTED_METRICS


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('rate(foo_total{a="b", c=~"d|e"}[5m]) > 0', {"foo_total"}),
        ("sum by (rank, host) (a_bytes / on(rank) group_left(host) b_bytes) > bool 0.9", {"a_bytes", "b_bytes"}),
        ("x != x or abs(x) == Inf", {"x"}),
        ('time() - ts_seconds{rank=~"$rank"} > 5 * 60', {"ts_seconds"}),
        ("avg_over_time(up_ratio[10m] offset 1h) < 1e3 * max_ratio", {"up_ratio", "max_ratio"}),
        ("increase(n_total${sel}[$__rate_interval]) and on() vector(1)", {"n_total"}),
    ],
)
def test_metric_names_finds_selected_metrics_only(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_every_alert_expression_uses_only_exported_metrics(alert_rules: list[dict[str, Any]]) -> None:
    known = EXPORTED_METRICS | {"up"}  # Prometheus writes `up` for every scrape target itself
    for rule in alert_rules:
        used = metric_names(rule["expr"])
        assert used, f"{rule['alert']}: no metric found in {rule['expr']!r}"
        assert used <= known, f"{rule['alert']} uses {sorted(used - known)}"


def test_a_rank_that_stops_answering_is_alerted_on_by_its_target_and_by_its_vanished_series(
    alert_rules: list[dict[str, Any]],
) -> None:
    down = {rule["labels"]["severity"]: rule["expr"] for rule in alert_rules if rule["alert"] == "TrainingRankDown"}
    assert metric_names(down["warning"]) == {"up"} and 'job="tdeploy-training"' in down["warning"]
    assert metric_names(down["critical"]) == {"tdeploy_train_step"}
    assert "unless on(rank, host, train_job)" in down["critical"] and "and on(train_job)" in down["critical"]


def test_every_alert_has_a_warning_and_a_critical_level_with_a_summary(alert_rules: list[dict[str, Any]]) -> None:
    levels: dict[str, list[str]] = defaultdict(list)
    for rule in alert_rules:
        levels[rule["alert"]].append(rule["labels"]["severity"])
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    assert {name: sorted(found) for name, found in levels.items()} == {
        "TrainingGpuUtilizationLow": ["critical", "warning"],
        "TrainingLossNotFinite": ["critical", "warning"],
        "TrainingStalled": ["critical", "warning"],
        "TrainingMemoryHigh": ["critical", "warning"],
        "TrainingThroughputBelowBaseline": ["critical", "warning"],
        "TrainingRankDown": ["critical", "warning"],
    }


def _targets(dashboard: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(panel, target) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_dashboard_queries_use_only_exported_metrics_and_show_every_one(dashboard: dict[str, Any]) -> None:
    shown: set[str] = set()
    for panel, target in _targets(dashboard):
        used = metric_names(target["expr"])
        assert used <= EXPORTED_METRICS, f"panel {panel['title']!r} queries {sorted(used - EXPORTED_METRICS)}"
        shown |= used
    assert shown == EXPORTED_METRICS


def test_dashboard_picks_its_prometheus_through_a_datasource_variable(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel, target in _targets(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert target["datasource"] == panel["datasource"], panel["title"]
    for name in ("train_job", "host", "rank"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variables[name]["query"]["query"]).groups()
        assert label == name
        assert metric_names(selector) <= EXPORTED_METRICS


def test_dashboard_panels_have_unique_ids_and_titles(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in dashboard["panels"]]
    titles = [panel["title"] for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(ids) == len(set(ids))
    assert len(titles) == len(set(titles))
    assert dashboard["uid"] and dashboard["title"]
