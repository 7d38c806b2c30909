"""Alerts that reach someone: Alertmanager routing of the two alert levels, the Prometheus side of it, and a
Prefect automation that notifies a webhook when a flow run fails.

deployments/monitoring/alerts.yml gives every alert a warning and a critical level. `alertmanager_config`
routes each level to its own webhook receiver, groups a burst of one alert into one notification, repeats an
unresolved one (critical more often), and inhibits the warning of an alert while its critical level fires
for the same job. `prometheus_config` evaluates those rules and sends what fires to Alertmanager.

Webhook URLs are untrusted input: `AlertRouting` checks them (http or https, a host, no user:password), the
configurations are built as data and dumped with a YAML library (never pasted into YAML text), and messages
name a URL only by its scheme and host (`redacted`): the path of a chat webhook is its secret.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, Field, ValidationError

from tasks.errors import TransientError, UserError
from training.config import StrictModel

logger = logging.getLogger(__name__)

MONITORING_DIR = Path(__file__).resolve().parent.parent / "deployments" / "monitoring"
RULES_FILE = "alerts.yml"
LEVELS = ("critical", "warning")
"""The `severity` label values of alerts.yml, most urgent first."""
TRAINING_JOB = "tdeploy-training"
SERVING_JOB = "tdeploy-serving"
"""Scrape job names the rules select by (alerts.yml's header)."""
INHIBIT_EQUAL = ("alertname", "job", "train_job")
"""A critical alert silences the warning of the same alert, scrape job and training job (a label missing on
both sides, like train_job on serving alerts, counts as equal)."""
GROUP_BY = ("alertname", "severity", "job", "train_job")
MAX_URL_LENGTH = 2048


def redacted(url: str) -> str:
    """`url` as messages may show it: scheme and host only (a webhook's path or query is often its token)."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = f":{parts.port}" if _port(parts) else ""
    return (
        f"{parts.scheme}://{host}{port}/..."
        if parts.path.strip("/") or parts.query
        else f"{parts.scheme}://{host}{port}"
    )


def _port(parts: Any) -> int | None:
    try:
        return parts.port
    except ValueError:
        return None


def _check_webhook_url(url: str) -> str:
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(f"a URL of {len(url)} characters is too long; use at most {MAX_URL_LENGTH}")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        raise ValueError("a webhook URL has no spaces or control characters; percent-encode them (%20)")
    parts = urlsplit(url)
    shown = redacted(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"scheme {parts.scheme!r} is not http or https; write https://host/path")
    if not parts.hostname:
        raise ValueError(f"{shown} names no host; write https://host/path")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{shown} carries user:password; remove them from the URL (put a token in the receiver's path, or "
            "configure basic_auth in Alertmanager's http_config by hand)"
        )
    if _port(parts) is None and ":" in parts.netloc.rsplit("]", 1)[-1]:
        raise ValueError(f"{shown} has an invalid port; use a number from 1 to 65535")
    return url


WebhookUrl = Annotated[str, AfterValidator(_check_webhook_url)]


class AlertRouting(StrictModel):
    """Where each alert level goes: one webhook per level, and how often an unresolved alert repeats."""

    critical_webhook_url: WebhookUrl = Field(description="Webhook that receives critical alerts (act now).")
    warning_webhook_url: WebhookUrl = Field(description="Webhook that receives warnings (look at it today).")
    critical_repeat_interval_m: int = Field(
        default=60, ge=1, le=7 * 24 * 60, description="Minutes before an unresolved critical alert is resent."
    )
    warning_repeat_interval_m: int = Field(
        default=12 * 60, ge=1, le=7 * 24 * 60, description="Minutes before an unresolved warning is resent."
    )
    send_resolved: bool = Field(default=True, description="Also notify when an alert resolves.")


def routing(**fields: Any) -> AlertRouting:
    """An `AlertRouting` from untrusted values; UserError with one `field=value: problem` line per error."""
    try:
        return AlertRouting(**fields)
    except ValidationError as err:
        # Not format_validation_error: it would print the URL, whose path may be the webhook's token.
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in err.errors()]
        raise UserError("invalid alert routing: " + "; ".join(lines)) from err


def alertmanager_config(route: AlertRouting) -> dict[str, Any]:
    """Alertmanager's configuration: each severity to its webhook, warnings inhibited by their critical level."""
    receivers = {
        "critical": (route.critical_webhook_url, route.critical_repeat_interval_m),
        "warning": (route.warning_webhook_url, route.warning_repeat_interval_m),
    }
    return {
        "route": {
            # Unlabelled alerts (none in alerts.yml) go to the warning receiver rather than nowhere.
            "receiver": "tdeploy-warning",
            "group_by": list(GROUP_BY),
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": f"{route.warning_repeat_interval_m}m",
            "routes": [
                {
                    "matchers": [f'severity="{level}"'],
                    "receiver": f"tdeploy-{level}",
                    "repeat_interval": f"{repeat_m}m",
                    **({"group_wait": "10s"} if level == "critical" else {}),
                }
                for level, (_, repeat_m) in receivers.items()
            ],
        },
        "receivers": [
            {
                "name": f"tdeploy-{level}",
                "webhook_configs": [{"url": url, "send_resolved": route.send_resolved}],
            }
            for level, (url, _) in receivers.items()
        ],
        "inhibit_rules": [
            {
                "source_matchers": ['severity="critical"'],
                "target_matchers": ['severity="warning"'],
                "equal": list(INHIBIT_EQUAL),
            }
        ],
    }


def prometheus_config(
    alertmanagers: Sequence[str],
    training_targets: Sequence[str] = (),
    serving_targets: Sequence[str] = (),
    rules_file: Path | str = RULES_FILE,
    interval_s: int = 15,
) -> dict[str, Any]:
    """Prometheus' configuration: scrape the ranks and vLLM servers, evaluate alerts.yml, alert to Alertmanager."""
    for what, values in (("alertmanager", alertmanagers), ("target", [*training_targets, *serving_targets])):
        for value in values:
            _check_host_port(value, what)
    scrape = [(TRAINING_JOB, training_targets), (SERVING_JOB, serving_targets)]
    return {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
        "rule_files": [str(rules_file)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]} for job, targets in scrape if targets
        ],
    }


_HOST_PORT = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}:(?P<port>[0-9]{1,5})")
"""ASCII only: str.isdigit takes '²' (which int() refuses) and '٣' (which it reads as 3), isalnum takes 'ö'."""


def _check_host_port(value: str, what: str) -> None:
    match = _HOST_PORT.fullmatch(value)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise UserError(f"{what}={value!r} is not host:port", "write e.g. node1:9093 (ASCII letters, digits, . and -; a port from 1 to 65535)")


EXAMPLE_ROUTING = {
    "critical_webhook_url": "http://127.0.0.1:9095/critical",
    "warning_webhook_url": "http://127.0.0.1:9095/warning",
}
EXAMPLE_ALERTMANAGERS = ["127.0.0.1:9093"]
EXAMPLE_TRAINING_TARGETS = ["node1:9400", "node1:9401"]
EXAMPLE_SERVING_TARGETS = ["serve1:8000"]
"""The values of the shipped deployments/monitoring/alertmanager.yml and prometheus.yml."""


def shipped_texts() -> dict[str, str]:
    """The text of deployments/monitoring/alertmanager.yml and prometheus.yml as this module renders them."""
    header = (
        "# {what}.\n"
        "# Rendered by `tdeploy alerts render` (tasks/alerts.py) with example values: render your own with the\n"
        "# real webhook URLs and targets (tdeploy alerts render --help) rather than editing this copy.\n"
    )
    return {
        "alertmanager.yml": header.format(what="Alertmanager routing of the alerts.yml levels")
        + dump(alertmanager_config(AlertRouting(**EXAMPLE_ROUTING))),
        "prometheus.yml": header.format(what="Prometheus: scrape, evaluate alerts.yml, alert to Alertmanager")
        + dump(prometheus_config(EXAMPLE_ALERTMANAGERS, EXAMPLE_TRAINING_TARGETS, EXAMPLE_SERVING_TARGETS)),
    }


def dump(config: dict[str, Any]) -> str:
    """A configuration as YAML text (every value quoted as YAML needs it)."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=1000)


def write_configs(
    route: AlertRouting,
    out_dir: Path,
    alertmanagers: Sequence[str],
    training_targets: Sequence[str] = (),
    serving_targets: Sequence[str] = (),
) -> dict[str, Path]:
    """Write alertmanager.yml, prometheus.yml and a copy of alerts.yml into `out_dir`; their paths by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = {
        "alertmanager.yml": dump(alertmanager_config(route)),
        "prometheus.yml": dump(prometheus_config(alertmanagers, training_targets, serving_targets)),
        RULES_FILE: (MONITORING_DIR / RULES_FILE).read_text(),
    }
    paths = {}
    for name, text in texts.items():
        path = out_dir / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # atomic: Alertmanager or Prometheus never reload a half-written file
        paths[name] = path
    logger.info(
        "alert routing written to %s: critical -> %s, warning -> %s",
        out_dir,
        redacted(route.critical_webhook_url),
        redacted(route.warning_webhook_url),
    )
    return paths


FAILED_FLOW_RUN_EVENTS = ("prefect.flow-run.Failed", "prefect.flow-run.Crashed")
NOTIFICATION_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
NOTIFICATION_SUBJECT = "Prefect flow run {{ flow_run.name }} of {{ flow.name }} is {{ flow_run.state.name }}"
NOTIFICATION_BODY = (
    "Flow run {{ flow_run.name }} (id {{ flow_run.id }}) of flow {{ flow.name }} ended "
    "{{ flow_run.state.name }}: {{ flow_run.state.message }}"
)
"""Jinja templates the Prefect server renders when the automation fires (flow and flow run of the event)."""


class FailureNotification(StrictModel):
    """The Prefect automation that notifies a webhook of failed and crashed flow runs, as installed."""

    automation_name: str
    automation_id: str
    block_name: str
    created: bool = Field(description="True when this call created the automation, False when it updated it.")


def install_failure_notification(webhook_url: str, name: str = "tdeploy") -> FailureNotification:
    """Create or update (idempotently, by name) the automation that POSTs a failed flow run to `webhook_url`.

    The Prefect server's own event services run it: the trigger matches the flow-run state events, and the
    action renders the flow run's name and state message into a Custom Webhook block's JSON body.
    """
    try:
        url = _check_webhook_url(webhook_url)
    except ValueError as err:
        raise UserError(f"invalid webhook_url: {err}") from err
    if not re.fullmatch(NOTIFICATION_NAME_PATTERN, name):
        raise UserError(f"name={name!r} is not a notification name", "use lowercase letters, digits and - (tdeploy)")
    # Prefect takes about 2 s to import: only once the input is known to be good.
    import httpx
    from prefect.settings import PREFECT_API_URL

    try:
        return _install(url, name)
    except httpx.TransportError as err:
        raise TransientError(
            f"the Prefect API at {PREFECT_API_URL.value() or '(ephemeral)'} did not answer ({type(err).__name__})",
            "start the server (prefect server start) or point PREFECT_API_URL at it, then run again",
        ) from err


def _install(url: str, name: str) -> FailureNotification:
    """Save the webhook block and create or update the automation (Prefect is imported by the caller)."""
    from prefect.automations import Automation
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    block_name = f"{name}-flow-run-failed"
    # The URL (often a token itself) sits in the block's secrets, which the Prefect API and UI mask; the block
    # substitutes it into `url` when it sends.
    block = CustomWebhookNotificationBlock(
        name=block_name,
        url="{{webhook_url}}",
        secrets={"webhook_url": url},
        json_data={"source": "prefect", "subject": "{{subject}}", "body": "{{body}}"},
    )
    block_id = block.save(block_name, overwrite=True)
    trigger = EventTrigger(
        expect=set(FAILED_FLOW_RUN_EVENTS),
        match={"prefect.resource.id": "prefect.flow-run.*"},
        posture=Posture.Reactive,
        threshold=1,
        within=0,
    )
    action = SendNotification(block_document_id=block_id, subject=NOTIFICATION_SUBJECT, body=NOTIFICATION_BODY)
    automation_name = block_name
    description = "Notifies a webhook of failed and crashed flow runs (installed by tdeploy alerts notify-failures)."
    try:
        automation = Automation.read(name=automation_name)
    except ValueError:  # Automation.read's "not found"
        automation = Automation(
            name=automation_name, description=description, trigger=trigger, actions=[action]
        ).create()
        created = True
    else:
        automation.description, automation.trigger, automation.actions = description, trigger, [action]
        automation.enabled = True
        automation.update()
        created = False
    logger.info(
        "%s automation %s: failed flow runs -> %s", "created" if created else "updated", automation_name, redacted(url)
    )
    return FailureNotification(
        automation_name=automation_name, automation_id=str(automation.id), block_name=block_name, created=created
    )
