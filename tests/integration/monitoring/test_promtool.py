"""promtool accepts the alert rules and their unit tests pass; a moved threshold of either level fails them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.monitoring.conftest import MONITORING

pytestmark = pytest.mark.integration


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_rules_accepts_the_rules_file(promtool: str) -> None:
    proc = _promtool(promtool, "check", "rules", str(MONITORING / "alerts.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 12 rules found" in proc.stdout


def test_promtool_unit_tests_pass_for_both_levels_of_every_alert(promtool: str) -> None:
    proc = _promtool(promtool, "test", "rules", str(MONITORING / "alerts_test.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


# (alert and level, text in alerts.yml, replacement): each moves one threshold or duration a little.
MOVED = [
    ("gpu-warning", "tdeploy_gpu_utilization_ratio < 0.30", "tdeploy_gpu_utilization_ratio < 0.31"),
    ("gpu-critical", "tdeploy_gpu_utilization_ratio < 0.20", "tdeploy_gpu_utilization_ratio <= 0.20"),
    ("loss-warning", "[15m]) > 0", "[14m]) > 0"),
    ("loss-critical", "tdeploy_train_loss != tdeploy_train_loss or ", ""),
    ("stalled-warning", "> 5 * 60", "> 4 * 60"),
    ("stalled-critical", "> 15 * 60", "> 14 * 60"),
    ("memory-warning", "> 0.90", ">= 0.90"),
    ("memory-critical", "> 0.95", "> 0.96"),
    ("throughput-warning", "< 0.80 *", "< 0.79 *"),
    ("throughput-critical", "< 0.50 *", "<= 0.50 *"),
    ("rank-down-warning", 'up{job="tdeploy-training"} == 0', 'up{job=~"tdeploy-training|node-exporter"} == 0'),
    ("rank-down-warning-for", "== 0\n        for: 2m", "== 0\n        for: 3m"),
    ("rank-down-critical-running", "and on(train_job) tdeploy_train_step", "or on(train_job) tdeploy_train_step"),
    ("rank-down-critical-window", "tdeploy_train_step[1h]", "tdeploy_train_step[10m]"),
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
