"""A failed flow run reaches a webhook: the automation tasks/alerts.py installs on the session's real Prefect
server (its trigger and action services) POSTs the flow run's name and failure to a loopback receiver."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from prefect import flow
from prefect.automations import Automation
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.orchestration import get_client

from tasks.alerts import install_failure_notification
from tests.integration.monitoring.conftest import WebhookReceiver

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_harness")]


@flow(name="tdeploy-alert-drill", retries=0)
def _failing_flow() -> None:
    raise RuntimeError("injected failure for the alert drill")


@flow(name="tdeploy-alert-drill-ok")
def _passing_flow() -> int:
    return 1


@pytest.fixture
def drill_notification() -> Iterator[str]:
    """The name prefix of this test's automation and block, both deleted afterwards: the session's server is
    shared, and later tests' failing flows must not notify a receiver that is gone."""
    yield "tdeploy-drill"
    name = "tdeploy-drill-flow-run-failed"
    with contextlib.suppress(ValueError):  # not found: the test failed before installing it
        Automation.read(name=name).delete()
    with contextlib.suppress(ValueError):
        CustomWebhookNotificationBlock.delete(name)


def test_a_failed_flow_run_notifies_the_webhook_with_its_name(
    webhook_receiver: WebhookReceiver, drill_notification: str
) -> None:
    installed = install_failure_notification(f"{webhook_receiver.url}/prefect", name=drill_notification)
    again = install_failure_notification(f"{webhook_receiver.url}/prefect", name=drill_notification)
    assert installed.created and not again.created and again.automation_id == installed.automation_id
    automation = Automation.read(name=installed.automation_name)
    assert automation.enabled and len(automation.actions) == 1  # updated in place, not doubled
    with get_client(sync_client=True) as client:  # the URL is kept as a secret: the API masks it
        document = client.read_block_document_by_name(
            installed.block_name, CustomWebhookNotificationBlock.get_block_type_slug(), include_secrets=False
        )
    assert webhook_receiver.url not in str(document.data), document.data

    assert _passing_flow() == 1
    state = _failing_flow(return_state=True)
    assert state.is_failed()
    run_id = str(state.state_details.flow_run_id)

    received = webhook_receiver.wait_for(
        lambda got: any(run_id in body.get("body", "") for _, body in got), f"a notification naming {run_id}"
    )
    [(path, body)] = [(path, body) for path, body in received if run_id in body["body"]]
    assert path == "/prefect" and body["source"] == "prefect"
    assert "tdeploy-alert-drill is Failed" in body["subject"]
    assert "injected failure for the alert drill" in body["body"]
    with get_client(sync_client=True) as client:
        run_name = client.read_flow_run(state.state_details.flow_run_id).name
    assert f"Flow run {run_name} (id {run_id}) of flow tdeploy-alert-drill ended Failed" in body["body"]
    # Only the failed run notified: the passing one (which ran first) sent nothing.
    assert all("tdeploy-alert-drill-ok" not in body["subject"] for _, body in received), received
