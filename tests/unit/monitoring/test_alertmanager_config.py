"""The Alertmanager and Prometheus configurations tasks/alerts.py renders, and the checks on webhook URLs."""

from __future__ import annotations

import pytest
import yaml

from tasks.alerts import (
    LEVELS,
    alertmanager_config,
    install_failure_notification,
    prometheus_config,
    redacted,
    routing,
    shipped_texts,
    write_configs,
)
from tasks.errors import UserError
from tests.unit.monitoring.conftest import MONITORING

GOOD = {
    "critical_webhook_url": "https://hooks.example.com/T0/B1/secret",
    "warning_webhook_url": "http://10.0.0.5:8080/w",
}


def _rules_levels() -> set[str]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    return {rule["labels"]["severity"] for group in rules["groups"] for rule in group["rules"]}


@pytest.mark.parametrize("name", ["alertmanager.yml", "prometheus.yml"])
def test_the_shipped_configs_are_what_the_renderer_writes(name: str) -> None:
    assert (MONITORING / name).read_text() == shipped_texts()[name], f"re-render {name}: tdeploy alerts render"


def test_every_level_of_the_rules_routes_to_its_own_webhook() -> None:
    config = alertmanager_config(routing(**GOOD))
    assert _rules_levels() == set(LEVELS)
    urls = {r["name"]: r["webhook_configs"][0]["url"] for r in config["receivers"]}
    routes = {tuple(r["matchers"]): r["receiver"] for r in config["route"]["routes"]}
    assert routes == {('severity="critical"',): "tdeploy-critical", ('severity="warning"',): "tdeploy-warning"}
    assert urls == {"tdeploy-critical": GOOD["critical_webhook_url"], "tdeploy-warning": GOOD["warning_webhook_url"]}
    assert [r["repeat_interval"] for r in config["route"]["routes"]] == ["60m", "720m"]


def test_a_critical_alert_inhibits_the_warning_of_the_same_alert_and_job() -> None:
    [rule] = alertmanager_config(routing(**GOOD))["inhibit_rules"]
    assert rule == {
        "source_matchers": ['severity="critical"'],
        "target_matchers": ['severity="warning"'],
        "equal": ["alertname", "job", "train_job"],
    }


def test_prometheus_evaluates_the_rules_and_alerts_to_alertmanager() -> None:
    config = prometheus_config(["am1:9093"], ["node1:9400"], ["serve1:8000"])
    assert config["rule_files"] == ["alerts.yml"]
    assert config["alerting"] == {"alertmanagers": [{"static_configs": [{"targets": ["am1:9093"]}]}]}
    assert [job["job_name"] for job in config["scrape_configs"]] == ["tdeploy-training", "tdeploy-serving"]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://hooks.example.com/x", "scheme 'ftp' is not http or https"),
        ("file:///etc/passwd", "scheme 'file' is not http or https"),
        ("https:///path", "names no host"),
        ("https://bob:hunter2@hooks.example.com/T0", "carries user:password"),
        ("https://hooks.example.com:99999/T0", "invalid port"),
        ("https://hooks.example.com/T0\n  - url: http://evil", "no spaces or control characters"),
        ("https://hooks.example.com/" + "a" * 3000, "too long"),
    ],
)
def test_a_bad_webhook_url_is_refused_naming_the_field_without_its_secret(url: str, problem: str) -> None:
    with pytest.raises(UserError) as err:
        routing(**{**GOOD, "warning_webhook_url": url})
    message = str(err.value)
    assert message.startswith("invalid alert routing: warning_webhook_url: ") and problem in message, message
    assert "hunter2" not in message and "T0" not in message and "\n" not in message


def test_the_prefect_notification_refuses_a_url_with_credentials_before_reaching_the_server() -> None:
    with pytest.raises(UserError) as err:
        install_failure_notification("https://alice:s3cret@hooks.example.com/T0/token")
    assert "invalid webhook_url: https://hooks.example.com/... carries user:password" in str(err.value)
    assert "s3cret" not in str(err.value) and "T0" not in str(err.value)


@pytest.mark.parametrize("target", ["node1", "node1:0", "no de:9400", "-x:1", "node1:9400\nx: y", "a:70000"])
def test_a_bad_scrape_or_alertmanager_address_is_refused(target: str) -> None:
    with pytest.raises(UserError, match="is not host:port"):
        prometheus_config([target])
    with pytest.raises(UserError, match="is not host:port"):
        prometheus_config(["am:9093"], [target])


def test_redacted_keeps_scheme_host_and_port_only() -> None:
    assert redacted("https://hooks.slack.com/services/T/B/X") == "https://hooks.slack.com/..."
    assert redacted("http://127.0.0.1:9095") == "http://127.0.0.1:9095"


def test_write_configs_writes_the_three_files_loadable(tmp_path) -> None:
    paths = write_configs(routing(**GOOD), tmp_path / "out", ["am:9093"], ["node1:9400"])
    assert sorted(paths) == ["alertmanager.yml", "alerts.yml", "prometheus.yml"]
    assert yaml.safe_load(paths["alertmanager.yml"].read_text()) == alertmanager_config(routing(**GOOD))
    assert paths["alerts.yml"].read_text() == (MONITORING / "alerts.yml").read_text()
    assert not list((tmp_path / "out").glob(".*tmp"))


def test_tdeploy_alerts_render_writes_the_configs_and_shows_no_webhook_path(tmp_path) -> None:
    from typer.testing import CliRunner

    from flows.cli import app

    args = ["--warning-url", GOOD["warning_webhook_url"], "--training-target", "node1:9400"]
    result = CliRunner().invoke(
        app,
        ["alerts", "render", *args, "--out", str(tmp_path)],
        env={"TDEPLOY_CRITICAL_WEBHOOK_URL": GOOD["critical_webhook_url"]},
    )
    assert result.exit_code == 0, result.output
    assert "critical -> https://hooks.example.com/..." in result.output and "secret" not in result.output
    rendered = yaml.safe_load((tmp_path / "alertmanager.yml").read_text())
    assert rendered["receivers"][0]["webhook_configs"][0]["url"] == GOOD["critical_webhook_url"]
    assert yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"] == [
        {"targets": ["node1:9400"]}
    ]

    bad = CliRunner().invoke(app, ["alerts", "render", "--critical-url", "ftp://h/T0", *args, "--out", str(tmp_path)])
    assert bad.exit_code == 2
    assert "critical_webhook_url: scheme 'ftp' is not http or https" in bad.output and "T0" not in bad.output


def test_the_scrape_job_names_are_the_ones_the_rules_select_by() -> None:
    import re

    from tasks.alerts import SERVING_JOB, TRAINING_JOB

    selected = set(re.findall(r'job="([^"]+)"', (MONITORING / "alerts.yml").read_text()))
    assert selected == {TRAINING_JOB, SERVING_JOB}
    jobs = [c["job_name"] for c in prometheus_config(["am:9093"], ["n:1"], ["s:2"])["scrape_configs"]]
    assert jobs == [TRAINING_JOB, SERVING_JOB]
