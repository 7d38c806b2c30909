"""promtool accepts the alert rules and their unit tests pass; a moved threshold of either level fails them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.monitoring.conftest import MONITORING

pytestmark = pytest.mark.integration


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_rules_accepts_the_rules_file(promtool: str) -> None:
    proc = _promtool(promtool, "check", "rules", str(MONITORING / "alerts.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 22 rules found" in proc.stdout


def test_promtool_parses_every_dashboard_query(promtool: str, tmp_path: Path) -> None:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    # Grafana's variables as Prometheus would get them: a range for $__rate_interval, "All" for the selectors
    queries = [re.sub(r"\$\w+", ".*", expr.replace("$__rate_interval", "5m")) for expr in exprs]
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"panel:q{i}", "expr": q} for i, q in enumerate(queries)]}
        ]
    }
    (tmp_path / "dashboard-rules.yml").write_text(yaml.safe_dump(rules))
    proc = _promtool(promtool, "check", "rules", str(tmp_path / "dashboard-rules.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(queries)} rules found" in proc.stdout


def test_promtool_unit_tests_pass_for_both_levels_of_every_alert(promtool: str) -> None:
    proc = _promtool(promtool, "test", "rules", str(MONITORING / "alerts_test.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


# The ends of ServingLatencyHigh's two levels and the warning level of ServingErrorRateHigh, as alerts.yml writes them.
LATENCY_WARNING = "< 0.99\n        for: 10m\n        labels:\n          severity: warning"
LATENCY_CRITICAL = "< 0.99\n        for: 10m\n        labels:\n          severity: critical"
ERRORS = (
    'sum by (job, instance) (rate(http_requests_total{job="tdeploy-serving", status="5xx"}[5m]))\n'
    '          / sum by (job, instance) (rate(http_requests_total{job="tdeploy-serving"}[5m]))\n'
    "          > 0.01"
)
# (alert and level, text in alerts.yml, replacement): each moves one threshold or duration a little.
MOVED = [
    ("gpu-warning", "tdeploy_gpu_utilization_ratio < 0.30", "tdeploy_gpu_utilization_ratio < 0.31"),
    ("gpu-critical", "tdeploy_gpu_utilization_ratio < 0.20", "tdeploy_gpu_utilization_ratio <= 0.20"),
    ("loss-warning", "[15m]) > 0", "[14m]) > 0"),
    ("loss-critical", "tdeploy_train_loss != tdeploy_train_loss or ", ""),
    ("stalled-warning", "> 5 * 60", "> 4 * 60"),
    ("stalled-critical", "> 15 * 60", "> 14 * 60"),
    ("memory-warning", "capacity_bytes > 0.90", "capacity_bytes >= 0.90"),
    ("memory-critical", "capacity_bytes > 0.95", "capacity_bytes > 0.96"),
    ("throughput-warning", "< 0.80 *", "< 0.79 *"),
    ("throughput-critical", "< 0.50 *", "<= 0.50 *"),
    ("rank-down-warning", 'up{job="tdeploy-training"} == 0', 'up{job=~"tdeploy-training|node-exporter"} == 0'),
    ("rank-down-warning-for", 'training"} == 0\n        for: 2m', 'training"} == 0\n        for: 3m'),
    ("rank-down-critical-running", "and on(train_job) tdeploy_train_step", "or on(train_job) tdeploy_train_step"),
    ("rank-down-critical-window", "tdeploy_train_step[1h]", "tdeploy_train_step[10m]"),
    ("latency-warning-bound", 'le="0.15"', 'le="0.3"'),
    ("latency-warning-share", LATENCY_WARNING, LATENCY_WARNING.replace("< 0.99", "<= 0.99")),
    ("latency-warning-for", LATENCY_WARNING, LATENCY_WARNING.replace("10m", "11m")),
    ("latency-critical-bound", 'le="0.3"', 'le="0.15"'),
    ("latency-critical-share", LATENCY_CRITICAL, LATENCY_CRITICAL.replace("< 0.99", "< 0.975")),
    ("errors-warning", "          > 0.01\n", "          >= 0.01\n"),
    ("errors-critical", "          > 0.05\n", "          > 0.11\n"),
    ("errors-job", ERRORS, ERRORS.replace('job="tdeploy-serving", ', "").replace('{job="tdeploy-serving"}', "")),
    ("errors-status", ERRORS, ERRORS.replace('status="5xx"', 'status=~"4xx|5xx"')),
    ("kv-warning", "vllm:kv_cache_usage_perc > 0.90", "vllm:kv_cache_usage_perc >= 0.90"),
    ("kv-critical", "vllm:kv_cache_usage_perc > 0.95", "vllm:kv_cache_usage_perc > 0.98"),
    ("kv-critical-preempting", "0.95\n          and on(", "0.95\n          or on("),
    ("waiting-warning-for", "waiting > 0\n        for: 10m", "waiting > 0\n        for: 8m"),
    ("waiting-critical", "waiting > vllm:num_requests_running", "waiting >= vllm:num_requests_running"),
    ("serving-down-warning", 'up{job="tdeploy-serving"} == 0\n', 'up{job=~"tdeploy-serving|node-exporter"} == 0\n'),
    ("serving-down-critical", 'sum by (job) (up{job="tdeploy-serving"})', 'min by (job) (up{job="tdeploy-serving"})'),
]


@pytest.mark.parametrize(("level", "old", "new"), MOVED, ids=[m[0] for m in MOVED])
def test_a_moved_threshold_fails_the_rule_unit_tests(
    promtool: str, tmp_path: Path, level: str, old: str, new: str
) -> None:
    rules = (MONITORING / "alerts.yml").read_text()
    assert rules.count(old) == 1, f"{level}: {old!r} not found once in alerts.yml"
    (tmp_path / "alerts.yml").write_text(rules.replace(old, new))
    shutil.copy(MONITORING / "alerts_test.yml", tmp_path / "alerts_test.yml")
    assert _promtool(promtool, "check", "rules", str(tmp_path / "alerts.yml")).returncode == 0
    proc = _promtool(promtool, "test", "rules", str(tmp_path / "alerts_test.yml"))
    assert proc.returncode == 1, f"{level}: the tests did not notice {old!r} -> {new!r}"
    assert "FAILED" in proc.stdout + proc.stderr
