"""Our alert rules, evaluated by a real Prometheus, reach the right webhook through a real Alertmanager
(Debian's prometheus-alertmanager) routed by tasks/alerts.py: critical and warning to their own receivers,
and a warning silenced while its critical level fires for the same job."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tasks.alerts import alertmanager_config, dump, prometheus_config, routing
from tests import processes
from tests.integration.monitoring.conftest import MONITORING, WebhookReceiver
from training.network import listen_port

pytestmark = pytest.mark.integration

# The last step of "hung-job" was 20 minutes ago (TrainingStalled fires at both levels: > 5 and > 15 minutes),
# that of "slow-job" 10 minutes ago (only the warning fires). Neither level has a `for:`, so they fire at the
# first evaluation.
STALE_S = {"hung-job": 20 * 60, "slow-job": 10 * 60}


@pytest.fixture(scope="module")
def amtool() -> str:
    """Path of amtool (Debian's prometheus-alertmanager package)."""
    path = shutil.which("amtool")
    assert path, "amtool missing: bash .ci/setup --test (installs Debian's prometheus-alertmanager package)"
    return path


@pytest.fixture
def stale_trainer() -> Iterator[int]:
    """A metrics endpoint on loopback serving two jobs' last-step timestamps, as training/telemetry.py names them."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            now = time.time()
            lines = ["# TYPE tdeploy_train_last_step_timestamp_seconds gauge"]
            lines += [
                f'tdeploy_train_last_step_timestamp_seconds{{host="node1",rank="0",train_job="{job}"}} {now - age}'
                for job, age in STALE_S.items()
            ]
            body = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready (exit {proc.poll()}): {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)


def _start(cmd: list[str], ready_url: str, log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        proc = processes.start_group(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(ready_url, proc, log)
    except BaseException:
        processes.stop_group(proc)
        raise
    return proc


def _alert_labels(received: list[tuple[str, dict]], path: str) -> list[dict]:
    return [alert["labels"] for got, body in received if got == path for alert in body["alerts"]]


def test_the_shipped_configs_pass_amtool_and_promtool(amtool: str, promtool: str) -> None:
    proc = subprocess.run(
        [amtool, "check-config", str(MONITORING / "alertmanager.yml")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 inhibit rules" in proc.stdout and "2 receivers" in proc.stdout
    proc = subprocess.run(
        [promtool, "check", "config", str(MONITORING / "prometheus.yml")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 22 rules found" in proc.stdout  # the alerts.yml beside it


def test_a_url_with_yaml_syntax_stays_one_url_that_amtool_accepts(amtool: str, tmp_path: Path) -> None:
    tricky = "https://hooks.example.com/x:y?a='b'&c=\"d\",[1]&e={{.F}}#-z:w"
    config = alertmanager_config(routing(critical_webhook_url=tricky, warning_webhook_url="http://127.0.0.1:1/w"))
    (tmp_path / "alertmanager.yml").write_text(dump(config))
    proc = subprocess.run([amtool, "check-config", str(tmp_path / "alertmanager.yml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loaded = yaml.safe_load((tmp_path / "alertmanager.yml").read_text())
    assert loaded["receivers"][0]["webhook_configs"][0]["url"] == tricky


def test_alerts_reach_the_receiver_of_their_level_and_critical_inhibits_the_warning(
    webhook_receiver: WebhookReceiver, stale_trainer: int, tmp_path: Path
) -> None:
    route = routing(
        critical_webhook_url=f"{webhook_receiver.url}/critical", warning_webhook_url=f"{webhook_receiver.url}/warning"
    )
    am_config = alertmanager_config(route)
    for node in (am_config["route"], *am_config["route"]["routes"]):  # test timings only: notify within a second
        node |= {"group_wait": "1s", "group_interval": "1s"}
    am_port, prom_port = listen_port(), listen_port()
    (tmp_path / "alertmanager.yml").write_text(dump(am_config))
    prom = prometheus_config(
        [f"127.0.0.1:{am_port}"],
        training_targets=[f"127.0.0.1:{stale_trainer}"],
        rules_file=MONITORING / "alerts.yml",
        interval_s=1,
    )
    (tmp_path / "prometheus.yml").write_text(dump(prom))

    started = []
    try:
        started.append(
            _start(
                [
                    "prometheus-alertmanager",
                    f"--config.file={tmp_path / 'alertmanager.yml'}",
                    f"--storage.path={tmp_path / 'am-data'}",
                    f"--web.listen-address=127.0.0.1:{am_port}",
                    "--cluster.listen-address=",  # no gossip port: a single instance
                ],
                f"http://127.0.0.1:{am_port}/-/ready",
                tmp_path / "alertmanager.log",
            )
        )
        started.append(
            _start(
                [
                    "prometheus",
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                f"http://127.0.0.1:{prom_port}/-/ready",
                tmp_path / "prometheus.log",
            )
        )

        def both_arrived(received: list[tuple[str, dict]]) -> bool:
            jobs = {
                path: {labels["train_job"] for labels in _alert_labels(received, path)}
                for path in ("/critical", "/warning")
            }
            return "hung-job" in jobs["/critical"] and "slow-job" in jobs["/warning"]

        received = webhook_receiver.wait_for(both_arrived, "critical and warning notifications", timeout_s=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{am_port}/api/v2/alerts?inhibited=true", timeout=10) as resp:
            in_alertmanager = json.load(resp)
    finally:
        for proc in reversed(started):
            processes.stop_group(proc)

    common = {"alertname": "TrainingStalled", "job": "tdeploy-training", "host": "node1", "rank": "0"}
    critical = _alert_labels(received, "/critical")
    warning = _alert_labels(received, "/warning")
    assert critical and all(
        labels == {**common, "instance": labels["instance"], "severity": "critical", "train_job": "hung-job"}
        for labels in critical
    ), critical
    assert warning and all(
        labels == {**common, "instance": labels["instance"], "severity": "warning", "train_job": "slow-job"}
        for labels in warning
    ), warning
    assert {body["receiver"] for path, body in received} == {"tdeploy-critical", "tdeploy-warning"}
    assert all(body["receiver"] == f"tdeploy-{path.strip('/')}" for path, body in received)
    # The hung job's warning reached Alertmanager too, and is held back by its critical level.
    silenced = [
        a for a in in_alertmanager if a["labels"]["train_job"] == "hung-job" and a["labels"]["severity"] == "warning"
    ]
    assert len(silenced) == 1 and silenced[0]["status"]["state"] == "suppressed", in_alertmanager
    assert silenced[0]["status"]["inhibitedBy"], silenced
