"""`tdeploy run`: the deploy-training flow on this machine, with an ephemeral Prefect."""

from __future__ import annotations

import logging
import os

from rich.console import Console

from tasks.spec import DeploymentSpec

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def run_deployment(spec: DeploymentSpec) -> int:
    """Run the whole deploy-training flow for a validated spec; the command's exit code."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    from prefect import tags

    from flows.deploy import deploy_training
    from tasks.launch.orphans import Supervisor, crash_orphaned_flow_runs

    # An earlier `tdeploy run` killed outright could not end its flow run: say so in Prefect now.
    for crashed in crash_orphaned_flow_runs():
        err_console.print(crashed.describe(), markup=False, highlight=False)
    with tags(Supervisor.current().tag()):  # how the next `tdeploy run` recognises this one if it is killed
        state = deploy_training(spec, return_state=True)
    if not state.is_completed():
        err_console.print(f"deploy-training {state.name}: {state.message}", markup=False)
        return 1
    console.print(f"deploy-training completed for {spec.name}", style="green")
    return 0
