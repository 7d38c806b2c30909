"""`tdeploy alerts`: render the Alertmanager and Prometheus configurations that route the alert levels to
webhooks, and install the Prefect automation that notifies a webhook of failed flow runs.

Each command imports tasks.alerts when it runs. Webhook URLs can come from environment variables so that their
tokens stay out of shell history.
"""

from __future__ import annotations

from pathlib import Path

import typer

from flows.cli.common import EXIT_USER_ERROR, example

RENDER_EXAMPLE = (
    "tdeploy alerts render --critical-url https://hooks.example.com/page --warning-url "
    "https://hooks.example.com/chat --alertmanager 127.0.0.1:9093 --training-target node1:9400 --out monitoring"
)
NOTIFY_EXAMPLE = "tdeploy alerts notify-failures --webhook-url https://hooks.example.com/prefect"

app = typer.Typer(
    no_args_is_help=True,
    help="Alert routing (Alertmanager) and failed-flow-run notifications.",
    epilog=example(RENDER_EXAMPLE, NOTIFY_EXAMPLE),
)


def _fail(err: Exception) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(EXIT_USER_ERROR)


@app.command("render", epilog=example(RENDER_EXAMPLE))
def render(
    critical_url: str = typer.Option(
        ..., "--critical-url", envvar="TDEPLOY_CRITICAL_WEBHOOK_URL", help="Webhook for critical alerts."
    ),
    warning_url: str = typer.Option(
        ..., "--warning-url", envvar="TDEPLOY_WARNING_WEBHOOK_URL", help="Webhook for warnings."
    ),
    alertmanager: list[str] = typer.Option(
        ["127.0.0.1:9093"], "--alertmanager", help="host:port of an Alertmanager Prometheus alerts to (repeatable)."
    ),
    training_target: list[str] = typer.Option(
        [], "--training-target", help="host:port of a rank's metrics (run.metrics_port + local rank; repeatable)."
    ),
    serving_target: list[str] = typer.Option([], "--serving-target", help="host:port of a vLLM server (repeatable)."),
    critical_repeat_m: int = typer.Option(60, "--critical-repeat-m", help="Minutes before a critical alert repeats."),
    warning_repeat_m: int = typer.Option(720, "--warning-repeat-m", help="Minutes before a warning repeats."),
    out: Path = typer.Option(Path("monitoring"), "--out", help="Folder for the three files."),
) -> None:
    """Write alertmanager.yml (a webhook per level, critical inhibits warning), prometheus.yml and alerts.yml."""
    from tasks.alerts import redacted, routing, write_configs
    from tasks.errors import UserError

    try:
        route = routing(
            critical_webhook_url=critical_url,
            warning_webhook_url=warning_url,
            critical_repeat_interval_m=critical_repeat_m,
            warning_repeat_interval_m=warning_repeat_m,
        )
        paths = write_configs(route, out, alertmanager, training_target, serving_target)
    except UserError as err:
        raise _fail(err) from err
    typer.echo(
        f"critical -> {redacted(route.critical_webhook_url)}, warning -> {redacted(route.warning_webhook_url)}\n"
        + "\n".join(f"  {path}" for path in paths.values())
        + f"\ncheck: amtool check-config {paths['alertmanager.yml']}; promtool check config {paths['prometheus.yml']}"
    )


@app.command("notify-failures", epilog=example(NOTIFY_EXAMPLE))
def notify_failures(
    webhook_url: str = typer.Option(
        ..., "--webhook-url", envvar="TDEPLOY_FAILURE_WEBHOOK_URL", help="Webhook that receives failed flow runs."
    ),
    name: str = typer.Option("tdeploy", "--name", help="Prefix of the automation's and block's names."),
) -> None:
    """Create or update the Prefect automation that POSTs every failed or crashed flow run to a webhook."""
    from tasks.alerts import install_failure_notification, redacted
    from tasks.errors import UserError

    try:
        installed = install_failure_notification(webhook_url, name=name)
    except UserError as err:
        raise _fail(err) from err
    verb = "created" if installed.created else "updated"
    typer.echo(
        f"{verb} automation {installed.automation_name} ({installed.automation_id}): failed and crashed flow runs "
        f"-> {redacted(webhook_url)} (block {installed.block_name})"
    )
